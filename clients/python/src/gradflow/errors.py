"""The exception gradflow may raise into a training loop, and the warning it prints."""

from __future__ import annotations

from typing import Any, Dict


class TrainingAlert(RuntimeError):
    """A critical gradflow alert, raised from ``gf.step`` when ``on_alert="raise"``.

    ``alert`` is the alert as the server returned it (``kind``, ``subject``,
    ``severity``, ``title``, ``detail``, ``fix``, ``evidence``, ...).
    """

    def __init__(self, alert: Dict[str, Any]) -> None:
        self.alert = alert
        super().__init__(describe(alert))

    @property
    def kind(self) -> str:
        return str(self.alert.get("kind", ""))


class GradflowAlertWarning(UserWarning):
    """The warning category of alerts printed with ``on_alert="warn"``."""


class GradflowWarning(UserWarning):
    """Something gradflow cannot measure in this setup (sharded parameters, ...)."""


def describe(alert: Dict[str, Any]) -> str:
    """One readable paragraph: severity, kind, subject, title and the fix."""
    head = (
        f"[{alert.get('severity', '?')}] {alert.get('kind', '?')} on "
        f"{alert.get('subject', '?')}: {alert.get('title', '')}"
    )
    fix = alert.get("fix")
    return f"{head}\n  fix: {fix}" if fix else head

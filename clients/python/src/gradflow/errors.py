"""The exception gradflow may raise into a training loop, its warnings, and how an
alert reads."""

from __future__ import annotations

from typing import Optional

from .wire import Alert


class TrainingAlert(RuntimeError):
    """A critical gradflow alert, raised from ``gf.step`` when ``on_alert="raise"``.

    ``alert`` is the alert as the server returned it (``kind``, ``subject``,
    ``severity``, ``title``, ``detail``, ``fix``, ``evidence``, ...); ``page`` the
    run's dashboard page, named in the message.
    """

    def __init__(self, alert: Alert, page: Optional[str] = None) -> None:
        self.alert = alert
        self.page = page
        super().__init__(describe(alert) + (f"\n  see: {page}" if page else ""))

    @property
    def kind(self) -> str:
        return str(self.alert.get("kind", ""))


class GradflowAlertWarning(UserWarning):
    """Formerly the category of alerts shown with ``on_alert="warn"``, which are now
    logged on the ``gradflow.alerts`` logger only; kept so that warning filters
    naming it still work."""


class GradflowWarning(UserWarning):
    """Something gradflow cannot measure in this setup (sharded parameters, ...)."""


def describe(alert: Alert) -> str:
    """One readable paragraph: severity, kind, subject, title, where in the user's
    code the graph was cut (when the alert names it) and the fix."""
    lines = [
        f"[{alert.get('severity', '?')}] {alert.get('kind', '?')} on "
        f"{alert.get('subject', '?')}: {alert.get('title', '')}"
    ]
    cut = (alert.get("evidence") or {}).get("graph_cut") or {}
    frames = [
        f"{f.get('file')}:{f.get('line')}" + (f" in {f['function']}" if f.get("function") else "")
        for f in cut.get("stack") or []
        if isinstance(f, dict)
    ]
    if frames:
        lines.append(
            f"  where: {cut.get('module', '?')} ({cut.get('kind', '?')}) at "
            + ", called from ".join(frames)
        )
    fix = alert.get("fix")
    if fix:
        lines.append(f"  fix: {fix}")
    return "\n".join(lines)

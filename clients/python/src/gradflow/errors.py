"""The exception gradflow may raise into a training loop, and the warning it prints."""

from __future__ import annotations

from .wire import Alert


class TrainingAlert(RuntimeError):
    """A critical gradflow alert, raised from ``gf.step`` when ``on_alert="raise"``.

    ``alert`` is the alert as the server returned it (``kind``, ``subject``,
    ``severity``, ``title``, ``detail``, ``fix``, ``evidence``, ...).
    """

    def __init__(self, alert: Alert) -> None:
        self.alert = alert
        super().__init__(describe(alert))

    @property
    def kind(self) -> str:
        return str(self.alert.get("kind", ""))


class GradflowAlertWarning(UserWarning):
    """The warning category of alerts printed with ``on_alert="warn"``."""


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

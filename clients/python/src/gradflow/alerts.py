"""Alerts the server opened for this run, shown to the user once each.

Each new alert is a :class:`~gradflow.errors.GradflowAlertWarning`, attributed to the
user's line that called ``gf.step`` (not to gradflow or a framework calling it); a
warning or critical one is also logged with the run's dashboard URL
(:func:`gradflow._log.show_alert`), which warning filters do not silence.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from typing import Any, Callable, Deque, Iterable, Optional, Set

from ._log import show_alert, swallow, user_stacklevel
from .errors import GradflowAlertWarning, TrainingAlert, describe
from .wire import Alert

MODES = ("warn", "raise", None)


class AlertBox:
    """Filled by the reporter thread, emptied on the training thread (``gf.step``),
    where a warning is seen in the user's context and a TrainingAlert can stop it."""

    def __init__(self, mode: Optional[str]) -> None:
        if mode not in MODES:
            raise ValueError(f"on_alert must be 'warn', 'raise' or None, got {mode!r}")
        self.mode = mode
        # The run's dashboard page, named beside each alert logged (set by the watcher).
        self.dashboard: Optional[Callable[[], str]] = None
        self._seen: Set[Any] = set()
        self._new: Deque[Alert] = deque()
        self._lock = threading.Lock()

    def offer(self, alerts: Iterable[Alert]) -> None:
        with self._lock:
            for alert in alerts:
                key = alert.get("id", (alert.get("kind"), alert.get("subject")))
                if key not in self._seen:
                    self._seen.add(key)
                    self._new.append(alert)

    def deliver(self) -> None:
        """Warns about each new alert; raises the first critical one in raise mode."""
        if self.mode is None or not self._new:
            return
        with self._lock:
            batch = list(self._new)
            self._new.clear()
        critical = None
        for alert in batch:
            self._log(alert)
            if self.mode == "raise" and alert.get("severity") == "critical" and critical is None:
                critical = alert
                continue
            try:
                warnings.warn(describe(alert), GradflowAlertWarning, stacklevel=user_stacklevel())
            except Exception as exc:  # warnings turned into errors must not stop training
                swallow("showing an alert", exc)
        if critical is not None:
            raise TrainingAlert(critical)

    def _log(self, alert: Alert) -> None:
        level = _LEVELS.get(alert.get("severity", ""))
        if level is None:
            return
        try:
            where = f"\n  see: {self.dashboard()}" if self.dashboard is not None else ""
            show_alert(level, describe(alert) + where)
        except Exception as exc:
            swallow("logging an alert", exc)


_LEVELS = {"warning": logging.WARNING, "critical": logging.ERROR}

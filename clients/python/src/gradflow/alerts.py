"""Alerts the server opened for this run, shown to the user once each."""

from __future__ import annotations

import threading
import warnings
from collections import deque
from typing import Any, Deque, Iterable, Optional, Set

from ._log import swallow
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
            if self.mode == "raise" and alert.get("severity") == "critical" and critical is None:
                critical = alert
                continue
            try:
                warnings.warn(describe(alert), GradflowAlertWarning, stacklevel=4)
            except Exception as exc:  # warnings turned into errors must not stop training
                swallow("showing an alert", exc)
        if critical is not None:
            raise TrainingAlert(critical)

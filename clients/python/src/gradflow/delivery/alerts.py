"""Alerts the server opened for this run, said to the person running training once.

One channel: each new warning or critical alert is one record on the
``gradflow.alerts`` logger (:func:`gradflow._log.show_alert`: to stderr when the
program configured no logging), short — what, where, the fix and the run's page —
and never also a Python warning, so it is not said twice, and warning filters
(``-W ignore``, a library's ``filterwarnings``) do not hide it.

An episode is said once: the server may report the same alert on every poll, close
it and open it again (a loss that swings around a threshold), or a rank may see it
after another did; the terminal says a kind on a subject once, and again only if it
comes back more severe. The dashboard keeps every episode.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Deque, Dict, Iterable, Optional, Tuple

from .._log import show_alert, swallow
from ..errors import TrainingAlert, describe
from ..wire import Alert

MODES = ("warn", "raise", None)

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}

# The alerts said in the terminal, with the logging level of each severity (an
# `info` alert is a hint for the dashboard, not for the terminal).
_LEVELS = {"warning": logging.WARNING, "critical": logging.ERROR}


def _episode(alert: Alert) -> Tuple[str, str]:
    return str(alert.get("kind", "")), str(alert.get("subject", ""))


class AlertBox:
    """Filled by the reporter thread, emptied on the training thread (``gf.step``),
    where a TrainingAlert can stop the loop."""

    def __init__(self, mode: Optional[str]) -> None:
        if mode not in MODES:
            raise ValueError(f"on_alert must be 'warn', 'raise' or None, got {mode!r}")
        self.mode = mode
        # The run's dashboard page, named beside each alert (set by the watcher).
        self.dashboard: Optional[Callable[[], str]] = None
        # The most severe alert said of each kind on each subject.
        self._said: Dict[Tuple[str, str], int] = {}
        self._new: Deque[Alert] = deque()
        self._lock = threading.Lock()

    def offer(self, alerts: Iterable[Alert]) -> None:
        """The run's alerts as the server has them now: those not said yet are kept."""
        with self._lock:
            for alert in alerts:
                key = _episode(alert)
                rank = SEVERITY_RANK.get(str(alert.get("severity", "")), 0)
                if rank <= self._said.get(key, -1):
                    continue
                self._said[key] = rank
                self._new.append(alert)

    def deliver(self, *, raising: bool = True) -> None:
        """Says each new alert; in raise mode, raises the first critical one instead of
        saying it (``raising=False``, where an exception is unwinding already or the
        interpreter is exiting: it is said)."""
        if self.mode is None or not self._new:
            return
        with self._lock:
            batch = list(self._new)
            self._new.clear()
        critical = None
        for alert in batch:
            stops = self.mode == "raise" and alert.get("severity") == "critical"
            if stops and raising and critical is None:
                critical = alert
                continue
            self.say(alert)
        if critical is not None:
            raise TrainingAlert(critical, page=self._page())

    def say(self, alert: Alert) -> None:
        """The alert, on the alerts' logger, with the run's page."""
        level = _LEVELS.get(str(alert.get("severity", "")))
        if level is None:
            return
        try:
            page = self._page()
            show_alert(level, describe(alert) + (f"\n  see: {page}" if page else ""))
        except Exception as exc:
            swallow("showing an alert", exc)

    def _page(self) -> Optional[str]:
        try:
            return self.dashboard() if self.dashboard is not None else None
        except Exception:
            return None

"""Logging and the rule that gradflow never breaks the training loop.

Every entry point gradflow puts into a user's loop (hooks, ``step``, ``close``) runs
under :func:`guarded`: an exception inside gradflow is logged once per place and
swallowed, so a bug or an unexpected model never stops training. The one exception
that passes is :class:`~gradflow.errors.TrainingAlert`, raised only when the user
asked for it with ``on_alert="raise"``.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import Any, Callable, TypeVar

from .errors import TrainingAlert

logger = logging.getLogger("gradflow")

_reported: set[str] = set()
_lock = threading.Lock()

F = TypeVar("F", bound=Callable[..., Any])


def say(message: str) -> None:
    """A line for the person running training (run id, delivery summary)."""
    print(f"gradflow: {message}", file=sys.stderr, flush=True)


def swallow(where: str, exc: BaseException) -> None:
    """Logs an internal failure the first time it happens at `where`."""
    with _lock:
        first = where not in _reported
        _reported.add(where)
    if first:
        logger.warning(
            "gradflow: internal error in %s (training continues; further errors here are not "
            "logged): %s",
            where,
            exc,
            exc_info=(type(exc), exc, exc.__traceback__),
        )


def guarded(where: str, default: Any = None) -> Callable[[F], F]:
    """Runs the function, turning any exception but TrainingAlert into a log line."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except TrainingAlert:
                raise
            except Exception as exc:
                swallow(where, exc)
                return default

        return wrapper  # type: ignore[return-value]

    return decorate

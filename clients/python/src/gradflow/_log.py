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
import os
import sys
import threading
import warnings
from typing import Any, Callable, Optional, TypeVar

from .errors import GradflowWarning, TrainingAlert

logger = logging.getLogger("gradflow")
# Alerts the server opened: shown whatever the warning filters say (see `show_alert`).
alert_logger = logging.getLogger("gradflow.alerts")

_reported: set[str] = set()
_lock = threading.Lock()

F = TypeVar("F", bound=Callable[..., Any])


def say(message: str) -> None:
    """A line for the person running training (run id, delivery summary).

    Written as one string, newline included: ``print`` writes the text and the newline
    apart, and the ranks of a job share one stderr, so their lines would interleave."""
    try:
        sys.stderr.write(f"gradflow: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stderr never breaks training
        pass


def show_alert(level: int, message: str) -> None:
    """An alert for the person running training, through ``logging`` (so that
    ``-W ignore`` and ``warnings.filterwarnings("ignore")`` do not hide it). When the
    program has configured no logging, gradflow adds a handler writing to stderr."""
    if not alert_logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("gradflow: %(message)s"))
        alert_logger.addHandler(handler)
        alert_logger.propagate = False  # logging configured later does not print it twice
        alert_logger.setLevel(logging.INFO)
    alert_logger.log(level, message)


# Frames that are never where the user called gradflow from: gradflow itself and the
# training frameworks that call it for the user.
_FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "torch")


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller of this function that
    attributes the warning to the user's code: the first frame outside gradflow and
    the frameworks (under the Hugging Face Trainer, the line calling ``train()``)."""
    roots = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for name in _FRAMEWORKS:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            roots.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    level = 1
    frame: Optional[Any] = sys._getframe(1)
    while frame is not None and frame.f_back is not None:
        filename = frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(tuple(roots)) and not filename.startswith(
            "<frozen"
        ):
            return level
        frame = frame.f_back
        level += 1
    return level


def notice(message: str) -> None:
    """Something the client itself saw go wrong in the training loop, said once by the
    caller, and shown once: a :class:`~gradflow.errors.GradflowWarning` at the user's
    line when the warning filters show it, else (filtered out, or turned into an
    error that must not stop training) the alerts' log line, which they do not
    silence. Both at once printed every notice twice."""
    try:
        if not _warned(message, user_stacklevel() + 1):
            show_alert(logging.WARNING, message)
    except Exception as exc:
        swallow("showing a notice", exc)


def _warned(message: str, stacklevel: int) -> bool:
    """Issues `message` as a GradflowWarning at `stacklevel` (counted from the caller)
    and shows it as the warning filters and ``warnings.showwarning`` say; whether it
    was shown (or recorded, under ``catch_warnings(record=True)``)."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            warnings.warn(message, GradflowWarning, stacklevel=stacklevel + 1)
        except GradflowWarning:  # the filters turned it into an error
            return False
    for shown in caught:
        warnings.showwarning(
            shown.message, shown.category, shown.filename, shown.lineno, shown.file, shown.line
        )
    return bool(caught)


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

"""What gradflow says to the person running training on its alerts logger
(``gradflow.alerts``), collected for a test."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List


class _Collect(logging.Handler):
    def __init__(self, messages: List[str]) -> None:
        super().__init__(logging.DEBUG)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def alerts_said() -> Iterator[List[str]]:
    """The messages logged on ``gradflow.alerts`` inside the block, one per alert."""
    logger = logging.getLogger("gradflow.alerts")
    messages: List[str] = []
    handler = _Collect(messages)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)

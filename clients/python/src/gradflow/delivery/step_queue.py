"""The hand-off of steps from the training thread to the reporter thread.

The training thread only ``put``s to a bounded queue and never waits: a full queue
drops the step and counts it (``dropped_steps`` in later records). The reporter
thread takes a step at once when it was idle, and then gathers what arrives for
``gather`` seconds (or until a batch's worth is queued) before the next batch,
instead of waking on every step: each wake-up takes the interpreter's lock from the
training thread, so a fast loop's steps go out together, and a process killed
outright loses at most the last ``gather`` seconds.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import List, Optional, Protocol, Tuple

from .. import wire
from .tally import Tally


class Pending(Protocol):
    """A step on its way: its record is built on the reporter thread
    (``record.PendingStep``, whose numbers may still be on their way from the device)."""

    def record(self) -> wire.StepRecord: ...


class StepQueue:
    """Steps handed over by the training thread, taken in batches by the reporter."""

    def __init__(
        self, size: int, batch_size: int, flush_interval: float, gather: float, tally: Tally
    ) -> None:
        # None is the stop marker close puts last.
        self._queue: queue.Queue[Optional[Pending]] = queue.Queue(maxsize=size)
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.gather = gather
        self._tally = tally
        # Set to wake the thread early: a step while it is idle, a batch's worth queued
        # (or half the queue, when smaller), or close.
        self._wake = threading.Event()
        self._wake_at = max(1, min(batch_size, size // 2 if size > 0 else batch_size))
        self._idle = False
        self._busy = False  # the last batch held steps: gather before the next one

    def __len__(self) -> int:
        return self._queue.qsize()

    # -- training thread ---------------------------------------------------------

    def put(self, pending: Pending) -> None:
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self._tally.dropped += 1
        if self._idle or self._queue.qsize() >= self._wake_at:
            self._idle = False
            self._wake.set()

    def stop(self, timeout: float) -> None:
        """Wakes the reporter thread and puts the stop marker behind the last step
        (waiting up to `timeout` seconds for room)."""
        self._wake.set()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=max(0.1, timeout))
        self._wake.set()

    # -- reporter thread ---------------------------------------------------------

    def take(self) -> Tuple[List[Pending], bool]:
        """The next batch, after waiting as the module says; and whether the stop
        marker was reached."""
        if self._queue.qsize() < self._wake_at:
            if self._busy:
                self._wake.wait(self.gather)
            else:
                self._idle = True
                if self._queue.empty():
                    self._wake.wait(self.flush_interval)
                self._idle = False
        self._wake.clear()
        items: List[Pending] = []
        stopping = False
        while not stopping and len(items) < self.batch_size:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stopping = True
            else:
                items.append(item)
        self._busy = bool(items)
        return items, stopping

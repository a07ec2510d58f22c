"""A CPU's gradient norms taken on a worker thread while the optimizer steps.

On a CPU the norms' arithmetic (a loop of per-tensor norms: a CPU has no multi-tensor
kernel) is most of what measuring costs the training thread: ~1.8 ms a step at
Qwen2.5-0.5B's 290 tensors. The optimizer's pre-step hook hands the gradients to one
worker thread, which takes their norms while ``optimizer.step()`` runs (torch's
kernels leave the GIL, so both use a core), and the post-step hook waits for them
(asleep: no CPU) before any user code can touch the gradients again. Nothing but the
optimizer runs in between, so the norms are those of the gradients it steps with, as
when the training thread took them.

Only where that holds (:func:`leaves_grads`, :func:`alone_between`): an optimizer of
``torch.optim`` (none of them writes to ``.grad``), stepped without a closure (a
closure, Lightning's or L-BFGS's, runs backward inside the step), with no step hook
of its own between gradflow's pre- and post-step hooks but gradflow's own readers
(one that clips the gradients in place would race with the worker). Anywhere else,
and on a device (where the norms are one kernel launch), the training thread takes
them as before.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

from .vector import Piece

# torch.optim's optimizers that step with a closure that recomputes the gradients.
_CLOSURE_OPTIMIZERS = ("LBFGS",)

Norms = Callable[[List[torch.Tensor]], List[Piece]]


def leaves_grads(optimizer: Any) -> bool:
    """Whether `optimizer` is one of torch's own, which read the gradients without
    writing to them (a subclass from elsewhere may override ``step``)."""
    kind = type(optimizer)
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and kind.__module__.startswith("torch.optim.")
        and kind.__name__ not in _CLOSURE_OPTIMIZERS
    )


def alone_between(optimizer: Any, pre: int, post: int, readers: Iterable[int] = ()) -> bool:
    """Whether no step hook of the optimizer's own runs between the hooks with ids
    `pre` and `post` but those in `readers` (gradflow's, which only read): `pre` its
    last pre-step hook, `post` its first post-step hook after those readers (torch's
    global step hooks run before and after every optimizer's own)."""
    try:
        if next(reversed(optimizer._optimizer_step_pre_hooks), None) != pre:
            return False
        for key in optimizer._optimizer_step_post_hooks:
            if key == post:
                return True
            if key not in readers:
                return False
    except (AttributeError, TypeError):
        pass
    return False


class OverlappedNorms:
    """The one job in flight: the norms of one step's gradients, on the worker."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._job: Optional[Tuple[Future[List[Piece]], Norms, List[torch.Tensor]]] = None

    def start(self, norms: Norms, grads: List[torch.Tensor]) -> None:
        """`norms(grads)` on the worker, from now until :meth:`finish`."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradflow-norms")
        self._job = (self._pool.submit(norms, grads), norms, grads)

    @property
    def pending(self) -> bool:
        return self._job is not None

    def finish(self) -> Optional[List[Piece]]:
        """The norms, once the worker has them (taken here if the worker failed); None
        without a job."""
        job, self._job = self._job, None
        if job is None:
            return None
        future, norms, grads = job
        try:
            return future.result()
        except Exception:
            return norms(grads)

    def discard(self) -> None:
        """Forgets the job in flight, once the worker is done with it: the worker
        reads the gradients only while the step that handed them over lasts."""
        job, self._job = self._job, None
        if job is not None:
            with contextlib.suppress(Exception):
                job[0].result()

    def close(self) -> None:
        self.discard()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

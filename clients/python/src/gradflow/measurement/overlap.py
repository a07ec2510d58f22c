"""On a CPU, one worker thread for the arithmetic on a step's live tensors that can
run beside the training thread: the gradient norms while the optimizer steps, and
Adam's state until the next step. Only under an optimizer of ``torch.optim``
(:func:`leaves_grads`: none of them writes to ``.grad``); on a device the arithmetic
is already the device's, and elsewhere the training thread does it as before.

The gradient norms (a loop of per-tensor norms on a CPU, which has no multi-tensor
kernel: ~1.8 ms a step at Qwen2.5-0.5B's 290 tensors): the optimizer's pre-step hook
hands the gradients to the worker, which takes their norms while ``optimizer.step()``
runs (torch's kernels leave the GIL, so each uses a core), and the post-step hook
waits for them (asleep: no CPU) before any user code can touch the gradients again.
When every parameter is on the CPU the worker reads the gradients too: the first
read after backward wraps each fresh ``.grad`` in a Python object (~0.4 ms at 290
tensors), which the optimizer's own loop pays when nothing read them before it, so
the worker then finds them wrapped.
Nothing but the optimizer runs in between, so the norms are those of the gradients
it steps with, as when the training thread took them; :func:`alone_between` checks
that: no closure (Lightning's runs backward inside the step) and no step hook of the
optimizer's own between gradflow's pre- and post-step hooks (one that clips the
gradients in place would race with the worker), gradflow's own readers aside.

Adam's state on a sampled step (:mod:`gradflow.measurement.adam_state`), and the norm
weights' moments for their intended update on every step
(:func:`gradflow.measurement.intended.adam_later`), change only in the optimizer's
next step: the worker copies them, instead of the training thread, while the loop
goes on to the next forward and backward, and the next pre-step hook waits for the
copies. The reads are queued during the post-step hook and started in one job at its
end (:meth:`StepWorker.start_reads`). Only the copies: the arithmetic on them stays
the reporter thread's (a wait for it too cost 1.9 ms a step on average on a loaded
machine).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional, Tuple, TypeVar

import torch

# torch.optim's optimizers that step with a closure that recomputes the gradients.
_CLOSURE_OPTIMIZERS = ("LBFGS",)

# A job on the step's tensors: the gradient norms (a list of pieces), or the
# gradients' read with their norms (gradflow.measurement.measure._read_and_norm).
Norms = Callable[[List[torch.Tensor]], Any]
T = TypeVar("T")


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


class StepWorker:
    """One worker thread for arithmetic on a step's live tensors: the gradient norms,
    one job at a time, from the pre-step hook to the post-step hook; and reads of
    the optimizer's state after its step (:meth:`until_next_step`), which every
    pre-step hook waits for (:meth:`before_step`) before the optimizer changes it."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._job: Optional[Tuple[Future[Any], Norms, List[torch.Tensor]]] = None
        self._state_reads: List[Future[Any]] = []
        self._queued: List[Tuple[Future[Any], Callable[[], Any]]] = []

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradflow-norms")
        return self._pool.submit(fn, *args)

    def start(self, norms: Norms, grads: List[torch.Tensor]) -> None:
        """`norms(grads)` on the worker, from now until :meth:`finish`."""
        self._job = (self._submit(norms, grads), norms, grads)

    @property
    def pending(self) -> bool:
        return self._job is not None

    def finish(self) -> Any:
        """The job's result (the norms), once the worker has it (taken here if the
        worker failed); None without a job."""
        job, self._job = self._job, None
        if job is None:
            return None
        future, norms, grads = job
        try:
            return future.result()
        except Exception:
            return norms(grads)

    def discard(self) -> None:
        """Forgets the norms in flight, once the worker is done with them: the worker
        reads the gradients only while the step that handed them over lasts."""
        job, self._job = self._job, None
        if job is not None:
            with contextlib.suppress(Exception):
                job[0].result()

    def until_next_step(self, read: Callable[[], T]) -> Callable[[], T]:
        """`read()` on the worker, started by :meth:`start_reads` (the end of the
        post-step hook); what it reads must change only in the optimizer's next step,
        whose pre-step hook waits for it (so it should copy, and leave the arithmetic
        to the thread that assembles the step). Returns what gives its result (raising
        its error) to that thread."""
        future: Future[T] = Future()
        self._queued.append((future, read))
        self._state_reads = [f for f in self._state_reads if not f.done()]
        self._state_reads.append(future)
        return future.result

    def start_reads(self) -> None:
        """Starts the reads queued by :meth:`until_next_step`, in one job. Called once
        the training thread is done with the step's hooks: from then on the worker
        holds the GIL between its torch calls, and each torch call of the training
        thread would hand it over and wait to get it back."""
        queued, self._queued = self._queued, []
        if queued:
            self._submit(_run_reads, queued)

    def before_step(self) -> None:
        """Waits for the state reads still running (asleep)."""
        self.start_reads()
        reads, self._state_reads = self._state_reads, []
        for future in reads:
            with contextlib.suppress(Exception):
                future.result()

    def close(self) -> None:
        self.discard()
        self.before_step()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _run_reads(queued: List[Tuple[Future[Any], Callable[[], Any]]]) -> None:
    """Each read, its result or error set on its future (on the worker)."""
    for future, read in queued:
        try:
            future.set_result(read())
        except Exception as exc:
            future.set_exception(exc)

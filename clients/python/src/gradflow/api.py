"""What :func:`gradflow.watch` returns, as a type: :class:`Watch`.

Both the real :class:`gradflow.Watcher` and :class:`gradflow.NoopWatcher` (gradflow
disabled, a rank left out, a model it cannot watch) satisfy it, so code written
against it (the Hugging Face callback, a user's loop) needs no ``getattr`` probing.
Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Protocol, Sequence, runtime_checkable

from . import wire


@runtime_checkable
class Watch(Protocol):
    """A watched training run (or its stand-in that does nothing)."""

    @property
    def run_id(self) -> Optional[str]:
        """The run's id on the server; None when nothing is reported."""
        ...

    @property
    def enabled(self) -> bool:
        """Whether this process reports the run."""
        ...

    def step(
        self,
        loss: Any = None,
        *,
        step: Optional[int] = None,
        metrics: Optional[Mapping[str, Any]] = None,
        batch_ids: Any = None,
        micro_losses: Optional[Sequence[Any]] = None,
    ) -> None:
        """Records one optimizer step; call it after ``optimizer.step()``."""
        ...

    def read_grads_at_backward_end(self) -> None:
        """Reads this step's gradients when the next backward pass ends."""
        ...

    def alerts(self) -> List[wire.Alert]:
        """The run's open alerts, as the server has them now."""
        ...

    def close(self) -> None:
        """Removes the hooks and delivers what is left."""
        ...

    def __enter__(self) -> Watch: ...

    def __exit__(self, *exc: Any) -> None: ...

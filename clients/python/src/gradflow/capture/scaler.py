"""The loss scaler's state, read before ``update()`` consumes it.

``GradScaler.update()`` overwrites the scale and growth tracker in place and forgets
``found_inf``; so ``update`` is wrapped to clone them (on the device, no host sync)
just before it runs. ``step`` is wrapped too: on a step the scaler skips, the
optimizer's own hooks never fire, and gradients must still be read after unscaling.
``unscale_`` is wrapped so that a loop that unscales to clip has its gradients read
right after unscaling, before clipping changes them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import _torch_compat
from .._log import guarded
from ..measurement.layout import unwrap_optimizer


class ScalerTap:
    def __init__(
        self,
        scaler: Any,
        optimizer: Any,
        before_step: Callable[[], None],
        wants_grads: Callable[[], bool],
    ) -> None:
        self.scaler = scaler
        self._optimizer = optimizer
        self._before_step = before_step
        self._wants_grads = wants_grads
        self.captured: Optional[torch.Tensor] = None
        # scaler.update() calls: one per optimizer step, taken or skipped.
        self.updates = 0
        self._original_step = scaler.step
        self._original_update = scaler.update
        self._original_unscale = scaler.unscale_
        tap = self

        def unscale_(optimizer: Any) -> Any:
            result = tap._original_unscale(optimizer)
            tap._on_unscaled(optimizer)
            return result

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if tap._on_step(optimizer):
                # What scaler.step does first anyway (through the wrapper above, which
                # reads the gradients), also on steps it is about to skip. Outside the
                # guard: an error here (fp16 gradients, bf16 ones on CUDA) is the
                # user's own, raised as scaler.step would raise it, with nothing of
                # gradflow's said.
                tap.scaler.unscale_(optimizer)
            return tap._original_step(optimizer, *args, **kwargs)

        def update(*args: Any, **kwargs: Any) -> Any:
            tap.updates += 1
            tap._on_update()
            return tap._original_update(*args, **kwargs)

        self._step, self._update, self._unscale = step, update, unscale_
        scaler.step = step
        scaler.update = update
        scaler.unscale_ = unscale_

    def enabled(self) -> bool:
        is_enabled = getattr(self.scaler, "is_enabled", None)
        return bool(is_enabled()) if callable(is_enabled) else True

    @guarded("scaler.step", default=False)
    def _on_step(self, optimizer: Any) -> bool:
        """Before scaler.step: whether to unscale first (the gradients are then read
        by the unscale_ wrapper), else reads them now."""
        if unwrap_optimizer(optimizer) is not self._optimizer or not self._wants_grads():
            return False
        if self.enabled() and _torch_compat.scaler_unscale_pending(self.scaler, optimizer):
            return True
        self._before_step()
        return False

    @guarded("scaler.unscale_")
    def _on_unscaled(self, optimizer: Any) -> None:
        if unwrap_optimizer(optimizer) is self._optimizer and self._wants_grads():
            self._before_step()

    @guarded("scaler.update")
    def _on_update(self) -> None:
        self.captured = self.read()

    def read(self) -> Optional[torch.Tensor]:
        """[scale, growth_tracker, found_inf] as f32 on the scaler's device, or None."""
        if not self.enabled():
            return None
        return _torch_compat.scaler_state(self.scaler)

    def take(self) -> Optional[torch.Tensor]:
        """The state captured at the last update (or read now if update never ran)."""
        captured, self.captured = self.captured, None
        return captured if captured is not None else self.read()

    def uninstall(self) -> None:
        # Only undo our own wrapping, leaving the class methods and any wrapper someone
        # installed over ours.
        for attr, mine in (
            ("step", self._step),
            ("update", self._update),
            ("unscale_", self._unscale),
        ):
            if vars(self.scaler).get(attr) is mine:
                delattr(self.scaler, attr)

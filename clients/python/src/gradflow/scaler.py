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

from ._log import guarded
from .layout import unwrap_optimizer


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
        self._original_step = scaler.step
        self._original_update = scaler.update
        self._original_unscale = scaler.unscale_
        tap = self

        def unscale_(optimizer: Any) -> Any:
            result = tap._original_unscale(optimizer)
            tap._on_unscaled(optimizer)
            return result

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            tap._on_step(optimizer)
            return tap._original_step(optimizer, *args, **kwargs)

        def update(*args: Any, **kwargs: Any) -> Any:
            tap._on_update()
            return tap._original_update(*args, **kwargs)

        scaler.step = step
        scaler.update = update
        scaler.unscale_ = unscale_

    def enabled(self) -> bool:
        is_enabled = getattr(self.scaler, "is_enabled", None)
        return bool(is_enabled()) if callable(is_enabled) else True

    @guarded("scaler.step")
    def _on_step(self, optimizer: Any) -> None:
        if unwrap_optimizer(optimizer) is not self._optimizer or not self._wants_grads():
            return
        if self.enabled():
            states = getattr(self.scaler, "_per_optimizer_states", None)
            stage = states[id(optimizer)].get("stage") if states is not None else None
            if getattr(stage, "name", None) == "READY":
                # What scaler.step would do first anyway (through the wrapper above,
                # which reads the gradients), also on steps it is about to skip.
                self.scaler.unscale_(optimizer)
                return
        self._before_step()

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
        scale = getattr(self.scaler, "_scale", None)
        tracker = getattr(self.scaler, "_growth_tracker", None)
        if scale is None or tracker is None:
            return None
        found = None
        for state in getattr(self.scaler, "_per_optimizer_states", {}).values():
            for value in state.get("found_inf_per_device", {}).values():
                value = value.to(scale.device, torch.float32).reshape(())
                found = value if found is None else found + value
        if found is None:
            found = torch.full((), float("nan"), device=scale.device)
        return torch.stack(
            [scale.detach().float().reshape(()), tracker.detach().float().reshape(()), found]
        )

    def take(self) -> Optional[torch.Tensor]:
        """The state captured at the last update (or read now if update never ran)."""
        captured, self.captured = self.captured, None
        return captured if captured is not None else self.read()

    def uninstall(self) -> None:
        # Only undo our own wrapping (instance attributes), leaving the class methods.
        for attr in ("step", "update", "unscale_"):
            if attr in vars(self.scaler):
                delattr(self.scaler, attr)

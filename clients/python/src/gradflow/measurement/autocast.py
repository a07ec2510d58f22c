"""The forward's compute dtype under autocast, sampled in the model's first training
forwards and sent as the registration's ``precision.compute_dtype`` in an
amendment (``watch`` runs before the loop enters its ``torch.autocast`` block, so
the registration itself cannot know it).

Why: fp16 autocast without a loss scaler flushes every gradient below fp16's
smallest subnormal (6e-8) to zero in backward, silently. The server names that
cause of a zero gradient only when the forward really ran in fp16 and no scaler is
watched; bf16 has fp32's exponent range and needs none.

How, cheaply: a forward pre-hook on the watched model reads torch's autocast state
for the device type of the model's first parameter (two C calls), on forwards with
gradients enabled only (an evaluation under ``no_grad`` is not training), during the
first ``LOOKS`` of them, then removes itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .._log import swallow

# Training forwards sampled.
LOOKS = 8
# Autocast dtypes as the protocol names them; fp16 is the one that needs a scaler.
NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}


class AutocastProbe:
    """Which autocast dtype the first training forwards of ``model`` ran under."""

    def __init__(self, model: nn.Module) -> None:
        self._looks = 0
        self._seen: Optional[str] = None
        self._sent: Optional[str] = None
        self._handle: Optional[Any] = None
        try:
            first = next(model.parameters(), None)
            self._device = first.device.type if first is not None else "cpu"
            self._handle = model.register_forward_pre_hook(self._on_forward)
        except Exception as exc:
            swallow("watching the forward's autocast dtype", exc)

    def _on_forward(self, *_: Any) -> None:
        try:
            if not torch.is_grad_enabled():
                return
            self._looks += 1
            dtype = autocast_dtype(self._device)
            # fp16 wins: one fp16 training forward is enough to flush gradients.
            if dtype is not None and self._seen != "f16":
                self._seen = dtype
            if self._looks >= LOOKS:
                self.remove()
        except Exception as exc:
            swallow("watching the forward's autocast dtype", exc)
            self.remove()

    def take(self) -> Optional[str]:
        """The compute dtype seen, once each time it changes; None otherwise."""
        if self._seen is None or self._seen == self._sent:
            return None
        self._sent = self._seen
        return self._seen

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def autocast_dtype(device: str) -> Optional[str]:
    """The protocol's name of the autocast dtype in force for ``device`` (``f16``,
    ``bf16``), or None when autocast is off there."""
    try:
        enabled = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device)
    except (TypeError, AttributeError, RuntimeError):  # torch before 2.4
        if device == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        else:
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return NAMES.get(dtype) if enabled else None

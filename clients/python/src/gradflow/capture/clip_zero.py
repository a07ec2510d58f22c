"""Gradient clips with a limit of 0: ``clip_grad_norm_(max_norm=0)`` scales every
gradient it touches by 0, ``clip_grad_value_(clip_value=0)`` clamps them to 0. Torch
takes the 0 literally (a config value meant as "no clipping" often is 0), and the
model then trains on nothing while backward reaches every module. The server reads
the count sent as the step metric ``grads_clipped_to_zero`` to name the clip as the
cause of a zero gradient, instead of masks or dead units.

``clip_grad_norm_`` is seen through the module-level function it calls
(``_torch_compat.wrap_clip_grads``, so a ``clip_grad_norm_`` imported before
``watch`` is seen too); ``clip_grad_value_`` through the name
``torch.nn.utils.clip_grad_value_`` (``_torch_compat.wrap_clip_values``). Only clips
of the watched model's parameters count.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Set

import torch

from .. import _torch_compat
from .._log import swallow

METRIC = "grads_clipped_to_zero"


class ClipsToZero:
    """Counts, between two ``take()``, the clips of the watched parameters whose limit
    was 0."""

    def __init__(self, params: Set[int]) -> None:
        self._params = params
        self._count = 0
        self._restores: List[Callable[[], None]] = []
        try:
            for restore in (
                _torch_compat.wrap_clip_grads(self._on_norm_clip),
                _torch_compat.wrap_clip_values(self._on_clip),
            ):
                if restore is not None:
                    self._restores.append(restore)
        except Exception as exc:
            swallow("watching gradient clips", exc)

    def _on_norm_clip(self, parameters: Any, max_norm: Any, _total_norm: Any) -> None:
        self._on_clip(parameters, max_norm)

    def _on_clip(self, parameters: Any, limit: Any) -> None:
        try:
            if float(limit) != 0.0:
                return
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            if any(id(p) in self._params for p in parameters):
                self._count += 1
        except Exception as exc:
            swallow("watching gradient clips", exc)

    def take(self) -> Optional[int]:
        """Clips to 0 since the last call, or None when there were none."""
        count, self._count = self._count, 0
        return count or None

    def remove(self) -> None:
        for restore in self._restores:
            restore()
        self._restores.clear()

"""A gradient clip that ran before the backward that wrote the gradients the next
``optimizer.step()`` used (``zero_grad(); clip_grad_norm_(...); loss.backward();
optimizer.step()``, Cranial-XIX/FAMO#4): the clip finds nothing to cut (no gradient,
or only zeros) and every step uses the unclipped gradients. Part of
:mod:`gradflow.capture.loop_order`'s ``clip_after_step``: the clip acts on gradients
other than those the step uses.

The rule, per clip of the watched parameters that is the last one of its parameters
before a step:

- it found nothing: every one of its gradients was ``None`` (read at the clip, free),
  or (``clip_grad_norm_``) its total norm was 0 (read at the step, one host sync, and
  only when a write after the clip bumped the gradient's in-place version past the
  clip's own cut);
- and at the step those parameters hold gradients written since (a ``backward``);
- it matters only where the clip would have cut: the step's gradients (their 2-norm
  for ``clip_grad_norm_``, their largest element for ``clip_grad_value_``) are above
  its bound on at least ``CUTS`` steps. A clip before backward whose bound the
  gradients never reach changes nothing: silent.

A clip of other norm types (``norm_type=1``) is judged in the 2-norm, which is never
above the 1-norm: such a clip is said no more often than it would have cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from .. import _torch_compat

# Steps whose gradients were above the clip's bound before it is said.
CUTS = 2
# Norms the finding carries at most.
NORMS_SENT = 8


@dataclass
class _Clip:
    params: List[Any]
    bound: float
    name: str
    # The clip's total norm, when it found gradients (zeros, perhaps), and the
    # in-place version of one of them then; None when it found no gradient.
    total_norm: Optional[torch.Tensor]
    version: int


class ClipsBeforeBackward:
    """The clips since the last optimizer step that found nothing, judged at the step."""

    def __init__(self) -> None:
        self._pending: List[_Clip] = []
        # Steps whose gradients were written after a clip that found nothing.
        self.seen = 0
        # The norms those steps used, above the clip's bound.
        self.norms: List[float] = []
        self.bound = 0.0
        self.name = ""
        self.params = 0

    def clip(self, params: List[Any], bound: float, name: str, grad: Any, total_norm: Any) -> None:
        """A clip of the watched parameters that did not act on the gradients the
        last step used. ``grad``: the first gradient it found (None: none);
        ``total_norm``: ``clip_grad_norm_``'s, None for ``clip_grad_value_``."""
        if self._pending:
            # Only the last clip of the same parameters (known by the first) before the
            # step is the one it follows.
            self._pending = [c for c in self._pending if c.params[0] is not params[0]]
        if grad is None:
            self._pending.append(_Clip(params, bound, name, None, 0))
        elif isinstance(total_norm, torch.Tensor):
            version = _torch_compat.grad_version(grad)
            self._pending.append(_Clip(params, bound, name, total_norm, version))

    def step(self) -> bool:
        """Judges the clips since the last step, at this one; True once a clip before
        backward would have cut on ``CUTS`` steps."""
        pending, self._pending = self._pending, []
        for clip in pending:
            grad = next((p.grad for p in clip.params if p.grad is not None), None)
            if grad is None or not self._found_nothing(clip, grad):
                continue
            grads = [p.grad for p in clip.params if p.grad is not None]
            self.seen += 1
            used = _used_size(grads, clip.name)
            if used > clip.bound:
                self.norms.append(used)
                self.bound, self.name, self.params = clip.bound, clip.name, len(clip.params)
        return len(self.norms) >= CUTS

    @staticmethod
    def _found_nothing(clip: _Clip, grad: Any) -> bool:
        if clip.total_norm is None:
            return True  # no gradient then, some now: a backward wrote them since
        # The clip's own cut bumps the version once; a backward into the same tensor
        # bumps it again. Without a second bump nothing wrote after the clip.
        if _torch_compat.grad_version(grad) < clip.version + 2:
            return False
        return float(clip.total_norm) == 0.0

    def sent_norms(self) -> List[float]:
        return [float(f"{n:.4g}") for n in self.norms[:NORMS_SENT]]


def _used_size(grads: List[Any], name: str) -> float:
    """The 2-norm of the gradients (a norm clip's), or their largest element (a
    value clip's): one host read."""
    if name == "clip_grad_value_":
        return float(torch.stack(torch._foreach_norm(grads, math.inf)).max())
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))

"""The weights' fingerprint of the trainable modules that got no gradient on a step.

A module that backward never reaches because the graph was cut in front of it (a
stray ``torch.no_grad()`` or ``.detach()``) keeps the weights it started with: an
optimizer skips a parameter without a gradient. A target network copied in by hand
(DQN's hard update) or an EMA teacher averaged in place gets no gradient either, yet
its weights change. The fingerprint (``param_sum``: the sum of the module's trainable
weights after the step) lets the server tell the two apart (``grad_stuck_zero``
stands down on a module whose weights moved without a gradient).

Only the modules without a gradient are summed, and only on sampled steps: a healthy
run, where every trainable module has a gradient, pays one pass over the modules'
layout every ``every`` steps and no tensor operation.
"""

from __future__ import annotations

from typing import FrozenSet, List, Optional, Sequence, Tuple

import torch

from .ranks import param_sums

_NONE: FrozenSet[int] = frozenset()


def gradless_modules(
    module_grads: Sequence[Optional[Tuple[int, ...]]], trainable: Sequence[bool]
) -> FrozenSet[int]:
    """The trainable modules none of whose parameters had a gradient (by index)."""
    found = [m for m, grads in enumerate(module_grads) if grads is None and trainable[m]]
    return frozenset(found) if found else _NONE


def gradless_params(
    tensors: Sequence[torch.Tensor], module_of: Sequence[int], modules: FrozenSet[int]
) -> Tuple[List[torch.Tensor], List[int]]:
    """The parameters of `modules` that require grad (a frozen base inside a module is
    not summed), and the module of each."""
    picked: List[torch.Tensor] = []
    owners: List[int] = []
    for t, m in zip(tensors, module_of):
        if m in modules and t.requires_grad:
            picked.append(t)
            owners.append(m)
    return picked, owners


class GradlessSums:
    """The fingerprints of the modules without a gradient, the choice of parameters
    kept while the set of parameters with gradients (its layout) stays the same."""

    def __init__(self) -> None:
        self._layout: object = None
        self._modules: FrozenSet[int] = _NONE
        self._params: Tuple[List[torch.Tensor], List[int]] = ([], [])

    def clear(self) -> None:
        self._layout = None
        self._params = ([], [])

    def take(
        self,
        layout: object,
        module_grads: Sequence[Optional[Tuple[int, ...]]],
        trainable: Sequence[bool],
        tensors: Sequence[torch.Tensor],
        module_of: Sequence[int],
    ) -> Tuple[FrozenSet[int], Optional[torch.Tensor]]:
        """The modules summed and their sums (indexed by module, the others 0 and not
        to be sent; None when there is nothing to sum), for a step whose gradients
        lie as `layout` says."""
        if layout is not self._layout:
            self._modules = gradless_modules(module_grads, trainable)
            self._params = gradless_params(tensors, module_of, self._modules)
            self._layout = layout
        picked, owners = self._params
        if not picked:
            return self._modules, None
        return self._modules, param_sums(picked, owners, len(module_grads))

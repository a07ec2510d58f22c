"""The applied and intended update of every low-precision parameter, now and then.

Norm weights get their update measured every reported step (``measure.py``). Any
other bf16 or fp16 parameter can be frozen by rounding too — an embedding or a
linear layer whose AdamW steps are all below half an ulp — so every ``every``-th
reported step the trainable bf16/fp16 parameters that are not norm weights are
copied before the optimizer step (in their own dtype), and after it each one's
applied update norm and, for AdamW/Adam/SGD, the update the optimizer meant to apply
(norm, largest ratio to the ulp, non-zero elements, and how many of those rounded
away) are computed on the device, in chunks that bound the temporary memory. f32
parameters are left out: rounding does not freeze them. Of a sharded parameter
(FSDP2), each rank measures the elements it holds.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from . import intended
from .ranks import local
from .registration import Registry

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Elements per chunk of the f32 temporaries (before, after, update: 3 × 4 B each).
CHUNK_ELEMENTS = 16 * 1024 * 1024


class Updates(NamedTuple):
    """The low-precision parameters measured on a step: their names, one
    ``record.LowPrecisionUpdate`` row each (n × 5, on the device) and the elements
    this rank holds of each."""

    names: List[str]
    stats: torch.Tensor
    numels: List[int]


class UpdateTracker:
    def __init__(self, registry: Registry, every: int) -> None:
        self.registry = registry
        self.every = max(1, int(every))
        self._family = (
            intended.family(registry.optimizer) if registry.optimizer is not None else None
        )
        self._entries: List[Tuple[str, torch.Tensor, Optional[int]]] = []
        self._before: Optional[List[torch.Tensor]] = None
        self._stats: Optional[torch.Tensor] = None
        self._names: List[str] = []
        self._numels: List[int] = []
        self.rebuild()

    def rebuild(self) -> None:
        membership = self.registry._membership()
        entries = [
            (p.name, p.tensor, membership.get(id(p.tensor)))
            for p in self.registry.params
            if p.role != "norm" and p.tensor.requires_grad and p.tensor.dtype in LOW_PRECISION
        ]
        # Runs of one optimizer group and dtype share the intended-update arithmetic.
        entries.sort(key=lambda e: (e[2] is None, e[2] or 0, str(e[1].dtype)))
        self._entries = entries
        self._before = None
        self._stats = None

    def due(self, step: int) -> bool:
        return bool(self._entries) and step % self.every == 0

    def before_step(self) -> None:
        self._before = [local(t).detach().clone() for _, t, _ in self._entries]

    def after_step(self) -> None:
        before, self._before = self._before, None
        if before is None or len(before) != len(self._entries):
            return
        groups = self.registry.optimizer.param_groups if self.registry.optimizer else []
        rows: List[torch.Tensor] = []
        names: List[str] = []
        numels: List[int] = []
        tensors = [t for _, t, _ in self._entries]
        indices = [g for _, _, g in self._entries]
        for start, end in intended.runs(tensors, indices, CHUNK_ELEMENTS):
            group_index = indices[start]
            chunk = tensors[start:end]
            b = torch.cat([x.reshape(-1).float() for x in before[start:end]])
            a = torch.cat([local(t).detach().reshape(-1).float() for t in chunk])
            sizes = [local(t).numel() for t in chunk]
            count = end - start
            diff = a - b
            applied = intended.segment_sums(diff * diff, sizes)
            summary = None
            if self._family is not None and group_index is not None and group_index < len(groups):
                upd = intended.update(
                    self._family, self.registry.optimizer, groups[group_index], chunk, b
                )
                if upd is not None:
                    summary = intended.summary(upd, b, a, chunk[0].dtype, sizes, count)
            if summary is None:
                summary = torch.full((count, 4), float("nan"), device=a.device)
            applied = applied.to(summary.dtype).reshape(-1, 1)
            rows.append(torch.cat([applied, summary], dim=1).reshape(-1))
            names.extend(name for name, _, _ in self._entries[start:end])
            numels.extend(sizes)
        self._stats = torch.cat(rows) if rows else None
        self._names = names
        self._numels = numels

    def take(self) -> Optional[Updates]:
        """What was measured at the last step, once."""
        stats, self._stats = self._stats, None
        if stats is None:
            return None
        return Updates(self._names, stats, self._numels)

    def discard(self) -> None:
        self._before = None
        self._stats = None

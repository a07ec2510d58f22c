"""The applied and intended update of every low-precision parameter, now and then.

Norm weights get their update measured on the first reported steps, then every
few steps and on every step of this check (``measure.py``,
``Instruments._norm_weights_due``). Any
other bf16 or fp16 parameter can be frozen by rounding too — an embedding or a
linear layer whose AdamW steps are all below half an ulp — so every ``every``-th
reported step the trainable bf16/fp16 parameters that are not norm weights are
copied before the optimizer step (in their own dtype), and after it each one's
applied update norm and, for AdamW/Adam/SGD, the update the optimizer meant to apply
(norm, largest ratio to the ulp, non-zero elements, and how many of those rounded
away) are computed on the device, in chunks that bound the temporary memory. f32
parameters are left out: rounding does not freeze them. Of a sharded parameter
(FSDP2), each rank measures the elements it holds.

The check's arithmetic moves about 275 bytes per element it checks (49 kernels:
the copies, the f32 widening, the intended update, the spacing of the dtype and
the per-parameter reductions), so its cost on a device is its memory traffic: 29 ms
on an H200 for Qwen2.5-0.5B's 494 M bf16 elements at once. A model with more than
``SLICE_ELEMENTS`` such elements is checked a slice at a time, in turn, one slice
each checked step: every parameter still gets checked, each report says which ones
it measured (absent: not measured), and ``update_rounded_away`` judges each report
over the parameters it holds: a group that spans the slices is judged about as
often as before, one that fits in a single slice once a round of the slices (it
needs two reports). Slices are cut by the parameters' global sizes, so every rank of
a sharded run checks the same parameters on the same steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from . import intended
from .ranks import is_dtensor, local
from .record import LowPrecisionUpdate, width
from .registration import Registry
from .vector import Deferred

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Elements per chunk of the f32 temporaries (before, after, update: 3 × 4 B each).
CHUNK_ELEMENTS = 16 * 1024 * 1024
# Elements checked on one step at most (beyond one parameter larger than that, alone
# in its slice): ~17 GB of the device's memory traffic, ~4 ms on an H200.
SLICE_ELEMENTS = 64 * 1024 * 1024


class Updates(NamedTuple):
    """The low-precision parameters measured on a step: their names, one
    ``record.LowPrecisionUpdate`` row each (n × 5, on the device) and the elements
    this rank holds of each."""

    names: List[str]
    stats: Union[torch.Tensor, Deferred]
    numels: List[int]


@dataclass(frozen=True)
class _RunPlan:
    """A run's numbers before and after the step (flat, in the parameters' dtype),
    what its intended update is computed from (None: not known), its dtype and each
    parameter's length."""

    before: torch.Tensor
    after: torch.Tensor
    given: Optional[intended.Inputs]
    dtype: torch.dtype
    sizes: List[int]


def _rows(plans: List[_RunPlan]) -> torch.Tensor:
    """One ``record.LowPrecisionUpdate`` row per parameter, run after run: arithmetic
    on copies, on any thread."""
    rows: List[torch.Tensor] = []
    for plan in plans:
        b = plan.before.float()
        a = plan.after.float()
        count = len(plan.sizes)
        diff = a - b
        applied = intended.segment_sums(diff * diff, plan.sizes)
        if plan.given is not None:
            upd = intended.apply(plan.given, b)
            summary = intended.summary(upd, b, a, plan.dtype, plan.sizes, count)
        else:
            summary = torch.full((count, 4), float("nan"), device=a.device)
        applied = applied.to(summary.dtype).reshape(-1, 1)
        rows.append(torch.cat([applied, summary], dim=1).reshape(-1))
    return torch.cat(rows)


def _sliced_runs(
    tensors: List[torch.Tensor], groups: List[Optional[int]]
) -> Tuple[List[Tuple[int, int]], List[List[int]]]:
    """The runs of :func:`intended.runs` (one group and dtype, within the chunk
    budget) cut at slice boundaries too, and each slice's run indices: consecutive
    tensors of at most ``SLICE_ELEMENTS`` elements together by their global sizes (a
    larger one alone)."""
    runs: List[Tuple[int, int]] = []
    slices: List[List[int]] = []
    start = 0
    while start < len(tensors):
        end, elements = start, 0
        while end < len(tensors):
            size = tensors[end].numel()
            if end > start and elements + size > SLICE_ELEMENTS:
                break
            elements += size
            end += 1
        first = len(runs)
        runs.extend(
            (start + a, start + b)
            for a, b in intended.runs(tensors[start:end], groups[start:end], CHUNK_ELEMENTS)
        )
        slices.append(list(range(first, len(runs))))
        start = end
    return runs, slices


class UpdateTracker:
    def __init__(self, registry: Registry, every: int) -> None:
        self.registry = registry
        self.every = max(1, int(every))
        self._family = (
            intended.family(registry.optimizer) if registry.optimizer is not None else None
        )
        self._entries: List[Tuple[str, torch.Tensor, Optional[int]]] = []
        # [start, end) runs of one optimizer group and dtype, each within the chunk
        # budget, and the elements this rank holds of each entry: fixed between
        # rebuilds (a dtype or group change is an amendment, which rebuilds).
        self._runs: List[Tuple[int, int]] = []
        # The runs' indices checked on each turn, and the turn (one a checked step).
        self._slices: List[List[int]] = []
        self._turn = 0
        self._checking: List[int] = []
        self._sizes: List[int] = []
        self._sharded = False
        self._states: List[intended.States] = []
        self._before: Optional[List[torch.Tensor]] = None
        self._stats: Optional[Union[torch.Tensor, Deferred]] = None
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
        tensors = [t for _, t, _ in entries]
        self._runs, self._slices = _sliced_runs(tensors, [g for _, _, g in entries])
        self._turn = 0
        self._sizes = [local(t).numel() for t in tensors]
        self._sharded = any(is_dtensor(t) for t in tensors)
        optimizer = self.registry.optimizer
        self._states = (
            [intended.States(optimizer, tensors[a:b]) for a, b in self._runs]
            if optimizer is not None
            else []
        )
        self._before = None
        self._stats = None

    def due(self, step: int) -> bool:
        return bool(self._entries) and step % self.every == 0

    def before_step(self) -> None:
        """Each run's parameters of this turn's slice before the optimizer step: one
        flat copy a run, in their own dtype."""
        tensors = [t for _, t, _ in self._entries]
        self._checking = self._slices[self._turn % len(self._slices)] if self._slices else []
        self._turn += 1
        self._before = [
            intended.local_flat(tensors[start:end], self._sharded)
            for start, end in (self._runs[i] for i in self._checking)
        ]

    def after_step(self) -> None:
        """Each run's parameters after the step and the optimizer state their intended
        update needs, copied here; the arithmetic runs here on a device, and on the
        reporter thread on a CPU (:class:`gradflow.measurement.vector.Deferred`)."""
        before, self._before = self._before, None
        if before is None or len(before) != len(self._checking):
            return
        groups = self.registry.optimizer.param_groups if self.registry.optimizer else []
        plans: List[_RunPlan] = []
        names: List[str] = []
        tensors = [t for _, t, _ in self._entries]
        indices = [g for _, _, g in self._entries]
        for run, flat_before in zip(self._checking, before):
            start, end = self._runs[run]
            group_index = indices[start]
            chunk = tensors[start:end]
            after = intended.local_flat(chunk, self._sharded)
            if after.shape != flat_before.shape:
                return  # a parameter was resized since the copy
            given = None
            if self._family is not None and group_index is not None and group_index < len(groups):
                given = intended.inputs(
                    self._family,
                    self.registry.optimizer,
                    groups[group_index],
                    chunk,
                    self._sharded,
                    self._states[run],
                )
            plans.append(
                _RunPlan(flat_before, after, given, chunk[0].dtype, self._sizes[start:end])
            )
            names.extend(name for name, _, _ in self._entries[start:end])
        if not plans:
            return
        compute = functools.partial(_rows, plans)
        device = plans[0].after.device
        numel = width(LowPrecisionUpdate) * len(names)
        self._stats = Deferred(numel, device, compute) if device.type == "cpu" else compute()
        self._names = names
        self._numels = [n for run in self._checking for n in self._sizes[slice(*self._runs[run])]]

    def take(self) -> Optional[Updates]:
        """What was measured at the last step, once."""
        stats, self._stats = self._stats, None
        if stats is None:
            return None
        return Updates(self._names, stats, self._numels)

    def discard(self) -> None:
        self._before = None
        self._stats = None

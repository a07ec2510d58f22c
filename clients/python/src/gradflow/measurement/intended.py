"""The update an optimizer meant to apply, in f32, before it was rounded to the
parameter's dtype: what decides whether rounding explains a weight that never moves.
Of a sharded parameter (FSDP2), the elements this rank holds.

Computed right after ``optimizer.step()`` from the state that step left (the new
moments and step count are exactly what it used), for the parameters the caller
passes, on their device, without a host sync. AdamW / Adam (also ``amsgrad``,
``maximize`` and ``decoupled_weight_decay``) and SGD (momentum, dampening-free
Nesterov, weight decay); any other optimizer gets no intended update.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from .. import _torch_compat
from .ranks import local, local_numel

_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def family(optimizer: Any) -> Optional[str]:
    if isinstance(optimizer, torch.optim.Adam) or type(optimizer).__name__ in ("Adam", "AdamW"):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return None


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each value of `x` (f32): the distance from |x| to the
    next representable value above it, exact at powers of two."""
    wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else torch.float64
    m = x.to(wide).abs().clamp_min(torch.finfo(dtype).tiny)
    nxt = (m + m * (0.75 * 2.0 ** -_MANTISSA[dtype])).to(dtype).to(wide)
    return (nxt - m).float()


def runs(
    tensors: List[torch.Tensor],
    groups: List[Optional[int]],
    budget: Optional[int] = None,
) -> List[Tuple[int, int]]:
    """[start, end) ranges of consecutive tensors in one optimizer group and dtype:
    each range shares the intended-update arithmetic. With `budget`, a range also
    ends before its elements would pass it (a range always holds one tensor)."""
    ranges = []
    start = 0
    while start < len(tensors):
        end, elements = start, 0
        while end < len(tensors):
            if groups[end] != groups[start] or tensors[end].dtype != tensors[start].dtype:
                break
            size = local_numel(tensors[end])
            if budget is not None and end > start and elements + size > budget:
                break
            elements += size
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The elements of `tensors`, one tensor after another, in one new tensor (a copy,
    in their dtype): one ``cat`` of 1-D tensors (norm weights, their optimizer state),
    else one flattening call; never an operation a tensor from Python. Not for
    DTensors (see :func:`local_flat`); under ``no_grad`` for parameters."""
    if tensors[0].dim() == 1:
        try:
            out = torch.cat(tensors)
        except RuntimeError:  # not all 1-D
            return _torch_compat.flatten_dense(tensors)
        return out if out.dim() == 1 else out.reshape(-1)
    return _torch_compat.flatten_dense(tensors)


def local_flat(tensors: List[torch.Tensor], sharded: bool) -> torch.Tensor:
    """This rank's elements of `tensors` (a DTensor's local shard when `sharded`),
    flat, detached, in their dtype."""
    if sharded:
        return torch.cat([local(t).detach().reshape(-1) for t in tensors])
    with torch.no_grad():
        return flat(tensors)


def _flat(tensors: List[torch.Tensor], sharded: bool) -> torch.Tensor:
    """This rank's elements of `tensors` (optimizer state or gradients: nothing that
    requires grad), flat, in f32."""
    if sharded:
        return local_flat(tensors, sharded).float()
    return flat(tensors).float()


class States:
    """The optimizer's state dicts of some parameters, looked up once and kept while
    the optimizer's state mapping is the same object of the same size: a lookup
    hashes the parameter through ``Tensor.__hash__``, a Python call a parameter. The
    optimizers update each parameter's dict in place; ``load_state_dict`` replaces
    the mapping, and a parameter's first step adds to it."""

    def __init__(self, optimizer: Any, params: List[torch.Tensor]) -> None:
        self._optimizer = optimizer
        self._params = params
        self._mapping: Any = None
        self._size = -1
        self._dicts: List[Dict[str, Any]] = []
        # Keys every dict was seen to hold, while the dicts are kept: an optimizer
        # adds a parameter's state at its first step and never takes it away.
        self._held: Set[str] = set()

    def get(self) -> List[Dict[str, Any]]:
        state = self._optimizer.state
        if state is not self._mapping or len(state) != self._size:
            dicts = [state.get(p) for p in self._params]
            self._dicts = [d if d is not None else {} for d in dicts]
            # Kept only once every parameter has its own dict (not a stand-in).
            complete = all(d is not None for d in dicts)
            self._mapping = state if complete else None
            self._size = len(state)
            self._held = set()
        return self._dicts

    def all_hold(self, key: str) -> bool:
        """Whether every parameter's state holds `key` (looked at once while the
        dicts are kept, instead of once a step)."""
        dicts = self.get()
        if key in self._held:
            return True
        held = all(key in d for d in dicts)
        if held and self._mapping is not None:
            self._held.add(key)
        return held


@dataclass(frozen=True)
class AdamInputs:
    """What Adam/AdamW's intended update is computed from, read right after the step:
    the moments (flat f32 copies) and the group's scalars."""

    m: torch.Tensor
    v: torch.Tensor
    lr: float
    wd: float
    eps: float
    bc1: Any  # 1 - beta1**step: a float, or a device scalar (capturable / fused)
    bc2_sqrt: Any
    decoupled: bool


@dataclass(frozen=True)
class SgdInputs:
    """What SGD's intended update is computed from: the gradients and the momentum
    buffers (flat f32 copies) and the group's scalars."""

    g: torch.Tensor
    buf: Optional[torch.Tensor]
    lr: float
    wd: float
    momentum: float
    nesterov: bool
    maximize: bool


Inputs = Union[AdamInputs, SgdInputs]


def inputs(
    kind: str,
    optimizer: Any,
    group: Dict[str, Any],
    params: List[torch.Tensor],
    sharded: bool = True,
    states: Optional[States] = None,
) -> Optional[Inputs]:
    """Everything the intended update of `params` (all in `group`) needs from the
    optimizer, copied now (the next step overwrites the state in place); None when
    the state does not allow it. `sharded` False: no parameter is a DTensor (their
    state is read without looking for a local shard). `states`: the parameters' state
    dicts, kept between steps."""
    states_of = (
        states.get() if states is not None else [optimizer.state.get(p) or {} for p in params]
    )
    if kind == "adam":
        later = adam_later(optimizer, group, states_of, sharded)
        return None if later is None else later()
    lr = float(group["lr"])
    wd = float(group.get("weight_decay", 0.0) or 0.0)
    if kind == "sgd":
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        g = _flat(grads, sharded)
        momentum = float(group.get("momentum", 0.0) or 0.0)
        buf = None
        if momentum:
            if any(s.get("momentum_buffer") is None for s in states_of):
                return None
            buf = _flat([s["momentum_buffer"] for s in states_of], sharded)
        return SgdInputs(
            g,
            buf,
            lr,
            wd,
            momentum,
            bool(group.get("nesterov")),
            bool(group.get("maximize")),
        )
    return None


def adam_later(
    optimizer: Any,
    group: Dict[str, Any],
    states_of: List[Dict[str, Any]],
    sharded: bool,
    checked: bool = False,
) -> Optional[Callable[[], AdamInputs]]:
    """Adam/AdamW's :func:`inputs` in two halves: read now, what may change before the
    next optimizer step (the group's scalars: a scheduler sets the lr right after
    this step) and whether every parameter has its moments yet; copied by the call
    returned, the moments and the step count, which only the next optimizer step
    changes (so it may run on another thread until then). None when the state does
    not allow it; `checked`: every parameter's state is known to hold its moments."""
    if not checked and any("exp_avg" not in s for s in states_of):
        return None
    b1, b2 = (float(b) for b in group["betas"])
    decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get(
        "decoupled_weight_decay", False
    )
    scalars = _AdamScalars(
        float(group["lr"]),
        float(group.get("weight_decay", 0.0) or 0.0),
        float(group["eps"]),
        b1,
        b2,
        bool(decoupled),
        "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq",
    )
    return functools.partial(_adam_copies, scalars, states_of, sharded)


@dataclass(frozen=True)
class _AdamScalars:
    """An Adam group's scalars as they were right after its step."""

    lr: float
    wd: float
    eps: float
    b1: float
    b2: float
    decoupled: bool
    second: str  # the second moment's key: max_exp_avg_sq under amsgrad


def _adam_copies(
    scalars: _AdamScalars, states_of: List[Dict[str, Any]], sharded: bool
) -> AdamInputs:
    """The moments' flat f32 copies and the bias corrections of the step count."""
    m = _flat([s["exp_avg"] for s in states_of], sharded)
    v = _flat([s[scalars.second] for s in states_of], sharded)
    count: Any = states_of[0]["step"]
    count = local(count) if isinstance(count, torch.Tensor) else count
    b1, b2 = scalars.b1, scalars.b2
    bc1: Any
    bc2_sqrt: Any
    if isinstance(count, torch.Tensor) and count.device.type != "cpu":
        # capturable / fused: the count lives on the device; reading it would sync.
        on_device = count.to(m.device, torch.float32)
        bc1 = 1 - b1**on_device
        bc2_sqrt = (1 - b2**on_device).sqrt()
    else:
        steps = float(count)
        bc1 = 1 - b1**steps
        bc2_sqrt = math.sqrt(1 - b2**steps)
    return AdamInputs(m, v, scalars.lr, scalars.wd, scalars.eps, bc1, bc2_sqrt, scalars.decoupled)


def apply(given: Inputs, before: torch.Tensor) -> torch.Tensor:
    """The flat f32 intended update from `given`, for parameters whose values before
    the step are `before` (flat f32). Arithmetic only: it can run on any thread."""
    if isinstance(given, AdamInputs):
        upd: torch.Tensor = (
            (given.m / given.bc1) / (given.v.sqrt() / given.bc2_sqrt + given.eps) * (-given.lr)
        )
        if given.decoupled and given.wd:
            upd = upd - (given.lr * given.wd) * before
        return upd
    g = given.g
    if given.maximize:
        g = -g
    if given.wd:
        g = g + given.wd * before
    if given.buf is not None:
        g = g + given.momentum * given.buf if given.nesterov else given.buf
    return g * (-given.lr)


def update(
    kind: str,
    optimizer: Any,
    group: Dict[str, Any],
    params: List[torch.Tensor],
    before: torch.Tensor,
    sharded: bool = True,
    states: Optional[States] = None,
) -> Optional[torch.Tensor]:
    """The flat f32 intended update of `params` (all in `group`), whose values before
    the step are `before` (flat f32); None when the state does not allow it (see
    :func:`inputs`)."""
    given = inputs(kind, optimizer, group, params, sharded, states)
    return None if given is None else apply(given, before)


def summary(
    upd: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
    dtype: torch.dtype,
    lengths: Optional[List[int]],
    count: int,
) -> torch.Tensor:
    """Per parameter: [|u|², max |u|/ulp(before), #u≠0, #(u≠0 and unchanged)], shape
    (count, 4), where `upd`, `before` and `after` hold the parameters' elements one
    after another, `lengths` of them each. A non-finite update makes its ratio NaN,
    never a number that hides it (amax over NaN is not reliable across devices).
    `lengths` None: the parameters hold as many elements each (reduced as the rows of
    a matrix)."""
    if lengths is None:
        rows = upd.view(count, -1)
        ratio = (upd.abs() / ulp(before, dtype)).view(count, -1)
        max_ratio = ratio.amax(1) + rows.sum(1) * 0.0
        nonzero = rows != 0
        unchanged = (after == before).view(count, -1)
        counted = nonzero.sum(1, dtype=torch.float32)
        rounded = (nonzero & unchanged).sum(1, dtype=torch.float32)
        return torch.stack([(rows * rows).sum(1), max_ratio, counted, rounded], dim=1)
    squared = segment_sums(upd * upd, lengths)
    max_ratio = segment_maxima(upd.abs() / ulp(before, dtype), lengths) + squared * 0.0
    nonzero = upd != 0
    counted = segment_counts(nonzero, lengths)
    rounded = segment_counts(nonzero & (after == before), lengths)
    wide = counted.dtype
    return torch.stack([squared.to(wide), max_ratio.to(wide), counted, rounded], dim=1)


# Per-parameter reductions of a flat vector that holds several parameters. Each is a
# multi-tensor kernel over views of the vector, one launch for every parameter:
# `index_add` onto a few bins serialises on a GPU's atomics (seconds a step for a
# 0.5B-parameter model), and a segmented reduction gives each parameter one thread
# block.


def segment_sums(values: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """The sum of each run of `lengths` consecutive elements of non-negative `values`,
    in f32. On a CPU one segmented sum: its multi-tensor kernel there is a loop of
    per-tensor norms, twice as slow."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        sums = _torch_compat.segment_sum(values, lengths)
        if sums is not None:
            return sums
    return _per_segment(values, lengths, functools.partial(_torch_compat.foreach_norm, ord=1))


def segment_sums_of_squares(values: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """The sum of the squares of each run of `lengths` consecutive elements of `values`,
    in f32: the squared 2-norms, one pass and no tensor of squares."""
    norms = _per_segment(values, lengths, _torch_compat.foreach_norm)
    return norms * norms


def segment_maxima(values: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """The largest of each run of `lengths` consecutive elements of non-negative
    `values` (0 for an empty run), in f32."""
    return _per_segment(values, lengths, _torch_compat.foreach_max)


def _per_segment(
    values: torch.Tensor,
    lengths: List[int],
    reduce: Callable[[List[torch.Tensor]], List[torch.Tensor]],
) -> torch.Tensor:
    parts = values.split(lengths)
    if all(lengths):
        return torch.stack(reduce(list(parts)))
    # A rank can hold no element of a sharded parameter: the reduction of nothing is 0.
    out = torch.zeros(len(lengths), device=values.device, dtype=torch.float32)
    held = [i for i, n in enumerate(lengths) if n]
    if held:
        out[held] = torch.stack(reduce([parts[i] for i in held]))
    return out


def segment_counts(mask: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """How many elements of each run of `lengths` consecutive elements of `mask` are
    true, exactly: in f32 while every run holds at most 2**24 elements (every partial
    sum of ones is exact there), in f64 counted one run at a time beyond."""
    if max(lengths, default=0) <= 1 << 24:
        return segment_sums(mask.float(), lengths)
    return torch.stack([part.count_nonzero() for part in mask.split(lengths)]).double()

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

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _torch_compat
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


def _flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """This rank's elements of `tensors` (a DTensor's local shard), flat, in f32."""
    return torch.cat([local(t).detach().reshape(-1) for t in tensors]).float()


def update(
    kind: str,
    optimizer: Any,
    group: Dict[str, Any],
    params: List[torch.Tensor],
    before: torch.Tensor,
) -> Optional[torch.Tensor]:
    """The flat f32 intended update of `params` (all in `group`), whose values before
    the step are `before` (flat f32); None when the state does not allow it."""
    states = [optimizer.state.get(p) or {} for p in params]
    lr = float(group["lr"])
    wd = float(group.get("weight_decay", 0.0) or 0.0)
    if kind == "adam":
        if any("exp_avg" not in s for s in states):
            return None
        b1, b2 = (float(b) for b in group["betas"])
        eps = float(group["eps"])
        second = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
        m = _flat([s["exp_avg"] for s in states])
        v = _flat([s[second] for s in states])
        count: Any = states[0]["step"]
        count = local(count) if isinstance(count, torch.Tensor) else count
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
        upd = (m / bc1) / (v.sqrt() / bc2_sqrt + eps) * (-lr)
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get(
            "decoupled_weight_decay", False
        )
        if decoupled and wd:
            upd = upd - (lr * wd) * before
        return upd
    if kind == "sgd":
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        g = _flat(grads)
        if group.get("maximize"):
            g = -g
        if wd:
            g = g + wd * before
        momentum = float(group.get("momentum", 0.0) or 0.0)
        if momentum:
            if any(s.get("momentum_buffer") is None for s in states):
                return None
            buf = _flat([s["momentum_buffer"] for s in states])
            g = g + momentum * buf if group.get("nesterov") else buf
        return g * (-lr)
    return None


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
    in f32."""
    return _per_segment(values, lengths, 1)


def segment_maxima(values: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """The largest of each run of `lengths` consecutive elements of non-negative
    `values` (0 for an empty run), in f32."""
    return _per_segment(values, lengths, math.inf)


def _per_segment(values: torch.Tensor, lengths: List[int], ord: float) -> torch.Tensor:
    parts = values.split(lengths)
    if all(lengths):
        return torch.stack(_torch_compat.foreach_norm(list(parts), ord))
    # A rank can hold no element of a sharded parameter: the norm of nothing is 0.
    out = torch.zeros(len(lengths), device=values.device, dtype=torch.float32)
    held = [i for i, n in enumerate(lengths) if n]
    if held:
        out[held] = torch.stack(_torch_compat.foreach_norm([parts[i] for i in held], ord))
    return out


def segment_counts(mask: torch.Tensor, lengths: List[int]) -> torch.Tensor:
    """How many elements of each run of `lengths` consecutive elements of `mask` are
    true, exactly: in f32 while every run holds at most 2**24 elements (every partial
    sum of ones is exact there), in f64 counted one run at a time beyond."""
    if max(lengths, default=0) <= 1 << 24:
        return segment_sums(mask.float(), lengths)
    return torch.stack([part.count_nonzero() for part in mask.split(lengths)]).double()

"""Adam(W)'s state read after the optimizer step, on the steps the ``adam`` interval
samples: per parameter, from its moments ``exp_avg`` (m) and ``exp_avg_sq`` (v, or
``max_exp_avg_sq`` under amsgrad) and the step count t its state holds,

    u = m̂ / (√v̂ + ε),   m̂ = m / (1 − β₁ᵗ),   v̂ = v / (1 − β₂ᵗ)

(the update divided by the lr, weight decay left out). Elements never updated
(``v = 0``: an embedding row whose token has not been seen) are left out of every
figure. Per parameter: [Σ u², max |u|, elements updated, elements with √v̂ < ε,
elements that carry gradient]; the record sums them per module (``adam`` of
``modules[]``, protocol v1.8).

Below ε counts (v1.10), and is a fraction of, only the elements that carry some of
the gradient, whose √v̂ is at least ``CARRIES`` (10⁻⁴) of the parameter's largest: an
output head's rows of tokens the data never uses get only the tiny softmax
probabilities of tokens it learnt to rule out, their √v̂ 10⁵ below the used rows',
and ε damping them hides no gradient scale (an ε above the gradients' scale, the
failure, puts the rows that carry the gradient below it too).

The moments are copied flat on the training thread (one flattening call each, a chunk
of parameters at a time, so the temporaries stay bounded) and the arithmetic runs on
the device, or on a CPU on the reporter thread from the copies
(:class:`gradflow.measurement.vector.Deferred`); on a CPU under one of torch's
optimizers, the worker thread gathers the moments and step counts from the state
dicts and copies them beside the next forward and backward, from the live state,
which only the next optimizer step changes and whose pre-step hook waits for it
(:mod:`gradflow.measurement.overlap`). Per-parameter reductions are multi-tensor kernels
(:func:`gradflow.measurement.intended.segment_sums`). Of a sharded parameter (FSDP2)
each rank reads the state of the elements it holds.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import intended, vector
from .overlap import StepWorker
from .ranks import is_dtensor, local_numel
from .registration import Registry
from .vector import Deferred, Piece

# Numbers per parameter: Σ u², max |u|, updated, below ε, carrying (see the module).
WIDTH = 5
# The share of a parameter's largest √v̂ below which an element counts as carrying
# none of its gradient (not counted below ε).
CARRIES = 1e-4
# Elements per chunk of the copies and temporaries (m, v, u and masks: ~5 × 4 B each).
CHUNK_ELEMENTS = 16 * 1024 * 1024

_EXP_AVG = operator.itemgetter("exp_avg")
_STEP = operator.itemgetter("step")


@dataclass(frozen=True)
class _GroupPlan:
    """The parameters of one optimizer group: their modules, tensors, each one's
    elements on this rank, and their state dicts (kept between steps)."""

    group: int
    modules: List[str]
    tensors: List[torch.Tensor]
    lengths: List[int]
    states: intended.States
    # Runs of parameters copied and reduced together (by dtype, within CHUNK_ELEMENTS).
    chunks: List[Tuple[int, int]]


@dataclass
class AdamTaken:
    """A sampled step's Adam numbers: one piece, WIDTH numbers per parameter, and the
    module of each parameter in that order."""

    piece: Piece
    modules: List[str]


class AdamState:
    """Reads the state of an Adam-family optimizer (see the module)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.optimizer = registry.optimizer
        self._plans: List[_GroupPlan] = []
        self._sharded = False
        # Set on a CPU under one of torch's optimizers: the moments are read there,
        # not copied here (gradflow.measurement.overlap).
        self.worker: Optional[StepWorker] = None
        self.rebuild()

    @property
    def readable(self) -> bool:
        """Whether the optimizer keeps Adam's moments (Adam, AdamW and their kin)."""
        return self.optimizer is not None and intended.family(self.optimizer) == "adam"

    def rebuild(self) -> None:
        """After registration or an amendment: the parameters of each group."""
        self._plans = []
        if not self.readable:
            return
        membership = self.registry._membership()
        params = self.registry.params
        self._sharded = any(is_dtensor(p.tensor) for p in params)
        for g in range(len(self.optimizer.param_groups)):
            mine = [p for p in params if membership.get(id(p.tensor)) == g]
            if not mine:
                continue
            tensors = [p.tensor for p in mine]
            self._plans.append(
                _GroupPlan(
                    g,
                    [p.module for p in mine],
                    tensors,
                    [local_numel(t) for t in tensors],
                    intended.States(self.optimizer, tensors),
                    intended.runs(tensors, [g] * len(tensors), CHUNK_ELEMENTS),
                )
            )

    def read(self) -> Optional[AdamTaken]:
        """After the optimizer step: this step's numbers (None: no state yet)."""
        pieces: List[Piece] = []
        modules: List[str] = []
        for plan in self._plans:
            if plan.group >= len(self.optimizer.param_groups):
                continue
            group = self.optimizer.param_groups[plan.group]
            dicts = plan.states.get()
            if not dicts or not all(map(operator.contains, dicts, ["exp_avg"] * len(dicts))):
                continue  # before the group's first step
            pieces.extend(self._chunks(plan, group, dicts))
            modules.extend(plan.modules)
        if not pieces:
            return None
        return AdamTaken(_joined(pieces), modules)

    def _chunks(self, plan: _GroupPlan, group: Any, dicts: List[Any]) -> List[Piece]:
        b1, b2 = (float(b) for b in group["betas"])
        eps = float(group["eps"])
        second = operator.itemgetter("max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq")
        coefficients = (b1, b2, eps)
        first = dicts[0]["exp_avg"]
        if self.worker is not None and first.device.type == "cpu" and not self._sharded:
            # The moments and step counts change only in the next optimizer step, whose
            # pre-step hook waits for the worker's copies of them: the worker also
            # gathers them from the state dicts (290 lookups and a stack of 290 step
            # counts at Qwen2.5-0.5B's size, cache-cold after the step); the
            # arithmetic on the copies runs on the reporter thread, as below.
            read = functools.partial(
                _copies, dicts, second, plan.lengths, coefficients, plan.chunks
            )
            copied = self.worker.until_next_step(read)
            count = WIDTH * len(plan.tensors)
            return [Deferred(count, first.device, functools.partial(_arithmetic, copied))]
        chunk = _gathered(dicts, second, plan.lengths, coefficients, self._sharded)
        pieces: List[Piece] = []
        for start, end in plan.chunks:
            compute = chunk(start, end)
            count = WIDTH * (end - start)
            device = first.device
            pieces.append(Deferred(count, device, compute) if device.type == "cpu" else compute())
        return pieces


def _chunk(
    m_all: List[torch.Tensor],
    v_all: List[torch.Tensor],
    steps: torch.Tensor,
    lengths: List[int],
    coefficients: Tuple[float, float, float],
    sharded: bool,
    start: int,
    end: int,
) -> Callable[[], torch.Tensor]:
    """Parameters [start, end)'s moments copied flat now, and the arithmetic on the
    copies, to run on any thread."""
    m = intended._flat(m_all[start:end], sharded)
    v = intended._flat(v_all[start:end], sharded)
    return functools.partial(_stats, m, v, steps[start:end], lengths[start:end], *coefficients)


def _gathered(
    dicts: List[Any],
    second: Callable[[Any], torch.Tensor],
    lengths: List[int],
    coefficients: Tuple[float, float, float],
    sharded: bool,
) -> Callable[[int, int], Callable[[], torch.Tensor]]:
    """The group's moments and step counts taken from its state dicts, and what copies
    a chunk of them (:func:`_chunk`)."""
    m_all = list(map(_EXP_AVG, dicts))
    v_all = list(map(second, dicts))
    steps = _steps(list(map(_STEP, dicts)))
    return functools.partial(_chunk, m_all, v_all, steps, lengths, coefficients, sharded)


def _copies(
    dicts: List[Any],
    second: Callable[[Any], torch.Tensor],
    lengths: List[int],
    coefficients: Tuple[float, float, float],
    chunks: List[Tuple[int, int]],
) -> List[Callable[[], torch.Tensor]]:
    """A group's moments copied, a chunk at a time, each chunk with its arithmetic (on
    the worker, before the next optimizer step)."""
    chunk = _gathered(dicts, second, lengths, coefficients, False)
    return [chunk(start, end) for start, end in chunks]


def _arithmetic(copied: Callable[[], List[Callable[[], torch.Tensor]]]) -> torch.Tensor:
    """The numbers of the worker's copies (on the reporter thread)."""
    return torch.cat([compute().double() for compute in copied()])


def _steps(counts: List[Any]) -> torch.Tensor:
    """Each parameter's step count, as one f32 tensor (on the device that holds them:
    a capturable or fused optimizer keeps them there; nothing is read to the host)."""
    if all(isinstance(c, torch.Tensor) for c in counts):
        return torch.stack([c.reshape(()) for c in counts]).float()
    return torch.tensor([float(c) for c in counts])


def _stats(
    m: torch.Tensor,
    v: torch.Tensor,
    steps: torch.Tensor,
    lengths: List[int],
    b1: float,
    b2: float,
    eps: float,
) -> torch.Tensor:
    """Per parameter [Σ u², max |u|, updated, below ε, carrying] (see the module), from flat
    copies of the moments, `lengths` elements each: arithmetic on any thread. The copies
    are overwritten.

    Every figure but u is a count against a threshold on v, so that arithmetic stays in
    v (√ is monotone): √v̂ ≥ CARRIES·max √v̂ is v ≥ CARRIES²·max v, and √v̂ < ε is
    v < ε²·(1 − β₂ᵗ). Where every parameter has taken the same number of steps (the
    usual case, seen without a device read when the counts are on the host), the bias
    corrections are two numbers instead of two tensors as long as the moments. One
    buffer holds every threshold and mask in turn: on a CPU a new tensor's first
    writes fault its pages in, the cost of several passes."""
    sizes = vector.to_device(torch.tensor(lengths), m.device)
    numel = m.numel()
    mask = torch.empty_like(v)

    def each(per_parameter: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(per_parameter, sizes, output_size=numel)

    def at_least(per_parameter: torch.Tensor) -> torch.Tensor:
        """1 where v is at least its parameter's number, else 0 (in `mask`)."""
        if m.device.type == "cpu":  # a third of the time of an index into every element
            torch.cat([x.expand(n) for x, n in zip(per_parameter, lengths)], out=mask)
            return torch.ge(v, mask, out=mask)
        return torch.ge(v, each(per_parameter), out=mask)

    first: Any
    second: Any
    if steps.device.type == "cpu" and bool((steps == steps[0]).all()) and steps[0] > 0:
        t = float(steps[0])
        first, second = 1 / (1 - b1**t), 1 - b2**t
    else:
        steps = vector.to_device(steps, m.device)
        first, second = each(1 / (1 - b1**steps)), each(1 - b2**steps)
    # An element carries its parameter's gradient from CARRIES of the largest √v̂ on, and
    # is updated once v > 0: the smallest v above 0 is the floor where that one is lower.
    smallest = torch.nextafter(v.new_zeros(()), v.new_ones(()))
    floor = torch.clamp_min(intended.segment_maxima(v, lengths) * (CARRIES * CARRIES), smallest)
    carried = intended.segment_counts(at_least(floor), lengths)
    # Below ε and carrying: from the floor up to ε²·(1 − β₂ᵗ), the carried ones less
    # those at or above both; none where every floor is at or above it (a healthy ε,
    # seen without a device read).
    below_eps = eps * eps * second
    if not isinstance(below_eps, float):
        above = torch.ge(v, torch.maximum(each(floor), below_eps), out=mask)
        high = intended.segment_counts(above, lengths)
    elif m.device.type == "cpu" and bool((floor >= below_eps).all()):
        high = carried
    else:
        high = intended.segment_counts(at_least(floor.clamp_min(below_eps)), lengths)
    updated = torch.gt(v, 0.0, out=mask)
    count = intended.segment_counts(updated, lengths)
    # u = m̂ / (√v̂ + ε), 0 where v = 0 (never updated).
    root = v.sqrt_().div_(second**0.5 if isinstance(second, float) else second.sqrt_())
    u = m.mul_(updated).mul_(first).div_(root.add_(eps))
    squares = intended.segment_sums_of_squares(u, lengths)
    largest = intended.segment_maxima(u.abs_(), lengths) + squares * 0.0  # NaN stays NaN
    wide = count.dtype
    numbers = [squares.to(wide), largest.to(wide), count, carried - high, carried]
    return torch.stack(numbers, dim=1).reshape(-1)


def _joined(pieces: List[Piece]) -> Piece:
    """The chunks' numbers as one piece: concatenated on a device; on a CPU computed
    together on the reporter thread."""
    tensors = [p for p in pieces if isinstance(p, torch.Tensor)]
    if len(tensors) == len(pieces):
        return torch.cat([t.reshape(-1) for t in tensors])
    numel = sum(vector.numel(p) for p in pieces)
    return Deferred(numel, torch.device("cpu"), functools.partial(_computed, pieces))


def _computed(pieces: List[Piece]) -> torch.Tensor:
    return torch.cat([vector.flat(p).double() for p in pieces])

"""A step's instability signals in its record (protocol v1.8), built on the reporter
thread from the step's vector: per module ``attn_max_logit``, ``attn_min_entropy``,
``act_rms``, ``act_absmax`` and ``adam``; ``output_logits``, ``moe`` and ``batch`` (with
v1.9's ``repeated_token_share``) at the top. What the measuring side put in the vector
is described here by position (:class:`SignalsAt`); a module's several captures in one
step (gradient accumulation) are combined: the largest logit, the smallest entropy, RMS
and log Z over every element, expert loads added up, the largest repeated-token share.
Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from .. import wire
from . import encode

# Batch ids a record carries at most, and bytes of one id (the protocol's limits).
MAX_BATCH_IDS = 1024
MAX_BATCH_ID_BYTES = 256
ADAM_WIDTH = 5


@dataclass(frozen=True)
class Captured:
    """One capture's numbers in the step's vector: `family`, the module it names,
    where its `width` numbers start."""

    family: str
    module: str
    offset: int
    width: int


@dataclass
class SignalsAt:
    """Where a step's signals lie in its vector (absolute positions, but the
    captures': theirs from `captured_base`), and the host values that come with them."""

    captured: List[Captured] = field(default_factory=list)
    # Where the forward's captures start: their offsets are from there (added here,
    # on the reporter thread, rather than by a copy of each capture on the training
    # thread).
    captured_base: int = 0
    # Adam: where its numbers start, and the module of each parameter (ADAM_WIDTH each).
    adam_at: Optional[int] = None
    adam_modules: List[str] = field(default_factory=list)
    micro_losses_at: Optional[int] = None
    micro_losses: int = 0
    batch_ids: Any = None  # a list, or a CPU tensor read here


def apply(signals: SignalsAt, rec: wire.StepRecord, v: Sequence[float]) -> None:
    """Adds the step's signals to `rec`."""
    fields: Dict[str, Dict[str, Any]] = {}
    by_family: Dict[str, Dict[str, List[Sequence[float]]]] = {}
    base = signals.captured_base
    for c in signals.captured:
        numbers = v[base + c.offset : base + c.offset + c.width]
        by_family.setdefault(c.family, {}).setdefault(c.module, []).append(numbers)
    for module, captures in by_family.get("attention", {}).items():
        fields.setdefault(module, {}).update(_attention(captures))
    for module, captures in by_family.get("activations", {}).items():
        fields.setdefault(module, {}).update(_activations(captures))
    if signals.adam_at is not None:
        for module, adam in _adam(signals, v).items():
            fields.setdefault(module, {})["adam"] = adam
    _merge_modules(rec, fields)
    logits = _output_logits(list(by_family.get("output_logits", {}).values()))
    if logits:
        rec["output_logits"] = cast(wire.OutputLogits, logits)
    moe = [_moe(module, captures) for module, captures in by_family.get("moe", {}).items()]
    if any(layer is not None for layer in moe):
        rec["moe"] = [cast(wire.MoeLayer, layer) for layer in moe if layer is not None]
    batch = _batch(signals, v)
    share = _repeated_tokens(list(by_family.get("tokens", {}).values()))
    if share is not None:
        batch["repeated_token_share"] = share
    if batch:
        rec["batch"] = cast(wire.BatchInfo, batch)


def _merge_modules(rec: wire.StepRecord, fields: Dict[str, Dict[str, Any]]) -> None:
    """The fields of each module into its entry, or a new entry for a module that has
    none (an attention module or block owns no parameter of its own: no gradient)."""
    fields = {name: f for name, f in fields.items() if f}
    if not fields:
        return
    modules = rec.setdefault("modules", [])
    for entry in modules:
        extra = fields.pop(entry["module"], None)
        if extra:
            entry.update(extra)  # type: ignore[typeddict-item]
    for name, extra in fields.items():
        modules.append(cast(wire.ModuleStep, {"module": name, **extra}))


def _attention(captures: List[Sequence[float]]) -> Dict[str, Any]:
    measured = [c for c in captures if c[2] == 1.0]
    if not measured:
        return {}
    top = max((c[0] for c in measured), key=_nan_first)
    low = min((c[1] for c in measured), key=_nan_low)
    return {"attn_max_logit": encode.number(top), "attn_min_entropy": encode.norm(low)}


def _activations(captures: List[Sequence[float]]) -> Dict[str, Any]:
    measured = [c for c in captures if c[1] > 0]  # NaN: changed in place, not read
    if not measured:
        return {}
    squares = sum(c[0] for c in measured)
    elements = sum(c[1] for c in measured)
    absmax = max((c[2] for c in measured), key=_nan_first)
    return {
        "act_rms": encode.norm(math.sqrt(squares / elements) if squares >= 0 else math.nan),
        "act_absmax": encode.norm(absmax),
    }


def _output_logits(captures: List[List[Sequence[float]]]) -> Optional[Dict[str, Any]]:
    measured = [c for module in captures for c in module if c[1] > 0]
    if not measured:
        return None
    tokens = sum(c[1] for c in measured)
    logz = sum(c[0] for c in measured) / tokens
    absmax = max((c[2] for c in measured), key=_nan_first)
    level = sum(c[3] for c in measured) / tokens
    return {
        "logz_mean": encode.number(logz),
        "absmax": encode.norm(absmax),
        "logit_mean": encode.number(level),
    }


def _repeated_tokens(captures: List[List[Sequence[float]]]) -> Optional[float]:
    """The largest share over every forward of the step (gradient accumulation)."""
    measured = [c[0] for module in captures for c in module if c[1] == 1.0]
    if not measured:
        return None
    return min(1.0, max(0.0, max(measured)))


def _moe(module: str, captures: List[Sequence[float]]) -> Optional[Dict[str, Any]]:
    measured = [c for c in captures if c[-1] > 0]
    if not measured:
        return None
    experts = len(measured[0]) - 2
    loads = [0] * experts
    for c in measured:
        for e in range(experts):
            loads[e] += encode.count(c[e]) or 0
    tokens = sum(c[-1] for c in measured)
    layer: Dict[str, Any] = {"module": module, "tokens_per_expert": loads}
    layer["router_z"] = encode.norm(sum(c[-2] for c in measured) / tokens)
    return layer


def _adam(signals: SignalsAt, v: Sequence[float]) -> Dict[str, Dict[str, Any]]:
    """Per module: the parameters' Adam numbers summed (see gradflow.measurement.adam_state)."""
    assert signals.adam_at is not None
    totals: Dict[str, List[float]] = {}
    for k, module in enumerate(signals.adam_modules):
        at = signals.adam_at + ADAM_WIDTH * k
        squares, largest, updated, below, carrying = v[at : at + ADAM_WIDTH]
        total = totals.setdefault(module, [0.0, 0.0, 0.0, 0.0, 0.0])
        total[0] += squares
        total[1] = max(total[1], largest, key=_nan_first)
        total[2] += updated
        total[3] += below
        total[4] += carrying
    out: Dict[str, Dict[str, Any]] = {}
    for module, (squares, largest, updated, below, carrying) in totals.items():
        count = encode.count(updated)
        if not count:
            continue  # no element of the module was ever updated
        out[module] = {
            "updated": count,
            # Of the elements that carry gradient (v1.10; see adam_state).
            "below_eps": min(1.0, max(0.0, below / carrying)) if carrying else 0.0,
            "update_rms": encode.norm(math.sqrt(squares / updated) if squares >= 0 else math.nan),
            "update_absmax": encode.norm(largest),
        }
    return out


def _batch(signals: SignalsAt, v: Sequence[float]) -> Dict[str, Any]:
    batch: Dict[str, Any] = {}
    ids = _ids(signals.batch_ids)
    if ids:
        batch["ids"] = ids
    if signals.micro_losses_at is not None and signals.micro_losses:
        at = signals.micro_losses_at
        batch["micro_losses"] = [encode.number(x) for x in v[at : at + signals.micro_losses]]
    return batch


def _ids(given: Any) -> List[str]:
    """The user's batch ids as the protocol takes them: strings of at most 256 bytes,
    at most 1024 of them (longer ones are cut, more are left out)."""
    if given is None:
        return []
    values = given.tolist() if hasattr(given, "tolist") else given
    if isinstance(values, (str, bytes, int, float)):
        values = [values]
    out = []
    for value in list(values)[:MAX_BATCH_IDS]:
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        text = text.encode("utf-8")[:MAX_BATCH_ID_BYTES].decode("utf-8", "ignore")
        if text:
            out.append(text)
    return out


def _nan_first(x: float) -> Tuple[bool, float]:
    """Orders a NaN above every number: a NaN among the values wins a max."""
    return (math.isnan(x), x if not math.isnan(x) else 0.0)


def _nan_low(x: float) -> Tuple[bool, float]:
    """Orders a NaN below every number: a NaN among the values wins a min."""
    return (not math.isnan(x), x if not math.isnan(x) else 0.0)

"""Which instability signals a run measures, and on which steps (protocol v1.8, v1.9).

Six families, each measured every k-th *reported* step (its interval; 0 is off):

- ``attention``: each attention module's largest pre-softmax logit and its smallest
  head entropy;
- ``activations``: each block's output RMS and largest absolute value;
- ``adam``: Adam(W)'s state per module after the optimizer step (the fraction of
  elements below ε, the update's RMS and largest value, divided by the lr);
- ``output_logits``: the output head's mean log Z, largest absolute logit and (v1.9)
  mean logit;
- ``moe``: each MoE layer's tokens per expert and router z;
- ``tokens`` (v1.9): how repetitive the batch's token ids are (the largest share of
  one id within a sequence), read from the input embedding on every reported step by
  default: a bad batch is one step, and what it costs is one sort of the ids.

The defaults keep all of them together within the client's cost target (BENCHMARKS.md,
"The instability signals' cost"). The registration states the families measured and
their intervals (``signals``), so the server can tell a step a family skipped from a
family never measured. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

FAMILIES = ("attention", "activations", "adam", "output_logits", "moe", "tokens")

# Every how many reported steps each family is measured by default. Chosen from the
# measured cost of each (BENCHMARKS.md): at these intervals all five together add
# well under the client's 1 ms of training-thread CPU a step at Qwen2.5-0.5B's
# module count. `tokens` is due on every step: the step a bad batch spikes is the one
# whose ids must be read.
DEFAULT_INTERVALS: Dict[str, int] = {
    "attention": 10,
    "activations": 10,
    "adam": 10,
    "output_logits": 10,
    "moe": 10,
    "tokens": 1,
}

# The kinds of module a user may point at (``signal_modules=``), by family.
MODULE_KINDS = {
    "attention": "attention",
    "blocks": "activations",
    "routers": "moe",
    "output": "output_logits",
    "embedding": "tokens",
}


@dataclass(frozen=True)
class SignalSettings:
    """The intervals asked for and the modules the user named, resolved once."""

    intervals: Dict[str, int] = field(default_factory=lambda: dict(DEFAULT_INTERVALS))
    # Per kind of module ("attention", "blocks", "routers", "output"): the modules or
    # module names the user pointed at, replacing the ones recognised.
    modules: Dict[str, List[Any]] = field(default_factory=dict)

    @classmethod
    def resolve(cls, signals: Any, signal_modules: Any) -> SignalSettings:
        """From ``watch``'s ``signals`` and ``signal_modules``; raises ValueError or
        TypeError naming what was wrong."""
        return cls(_intervals(signals), _modules(signal_modules))

    def interval(self, family: str) -> int:
        return self.intervals.get(family, 0)


def _intervals(signals: Any) -> Dict[str, int]:
    if signals is None or signals is True:
        return dict(DEFAULT_INTERVALS)
    if signals is False:
        return {family: 0 for family in FAMILIES}
    if not isinstance(signals, Mapping):
        raise TypeError(
            f"signals must be a dict of family -> interval in reported steps (0: off), "
            f"True, False or None; got {signals!r}"
        )
    out = dict(DEFAULT_INTERVALS)
    for family, interval in signals.items():
        if family not in FAMILIES:
            raise ValueError(
                f"signals: unknown family {family!r}; the families are {', '.join(FAMILIES)}"
            )
        out[family] = _interval(family, interval)
    return out


def _interval(family: str, interval: Any) -> int:
    if interval is None or interval is False:
        return 0
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(
            f"signals[{family!r}]: an interval is a whole number of reported steps "
            f"(0 or None: off), got {interval!r}"
        )
    return interval


def _modules(signal_modules: Any) -> Dict[str, List[Any]]:
    if signal_modules is None:
        return {}
    if not isinstance(signal_modules, Mapping):
        raise TypeError(
            "signal_modules must be a dict such as {'attention': ['blocks.0.attn'], "
            f"'blocks': [...], 'routers': [...], 'output': 'head'}}; got {signal_modules!r}"
        )
    out: Dict[str, List[Any]] = {}
    for kind, given in signal_modules.items():
        if kind not in MODULE_KINDS:
            raise ValueError(
                f"signal_modules: unknown kind {kind!r}; the kinds are {', '.join(MODULE_KINDS)}"
            )
        out[kind] = list(given) if isinstance(given, (list, tuple)) else [given]
    return out


class Schedule:
    """Which families are due on a step: every `every`-th step is reported, and a
    family is measured on every `interval`-th reported step, from step 0."""

    def __init__(self, intervals: Mapping[str, int], every: int) -> None:
        self.intervals = {f: k for f, k in intervals.items() if k > 0}
        self.every = max(1, every)

    def due(self, family: str, step: int) -> bool:
        interval = self.intervals.get(family)
        if interval is None or step < 0 or step % self.every:
            return False
        return (step // self.every) % interval == 0

    def any_due(self, step: int) -> bool:
        return any(self.due(family, step) for family in self.intervals)


def registration_signals(intervals: Mapping[str, int]) -> Optional[Dict[str, int]]:
    """The registration's ``signals``: each family measured, with its interval; None
    when none is."""
    measured = {f: k for f, k in intervals.items() if k > 0}
    return measured or None

"""``ReduceLROnPlateau`` stepped with a metric it reads the wrong way round: in its
default mode ``"min"`` a metric that rises (an accuracy, a score) never improves, so
every evaluation counts towards its patience and the lr is cut again and again while
the model gets better (md-mohaiminul/ViS4mer#4). Sent as the wiring finding
``plateau_mode_mismatch`` (protocol v1.10) in an amendment: ``attribute`` the
scheduler's mode, ``measured`` the lr cuts.

The rule, on the scheduler's own calls: the lr was cut at least ``CUTS`` times; no
metric since the first was better than the first under the scheduler's mode by more
than ``NOISE`` of how far the metric has since moved the other way (every cut came
from a metric that never improved on its first reading, beyond the jitter of its
first evaluations: a validation loss of 0.6924 then 0.6932 that falls to 0.47 did not
improve in mode ``"max"``, while one that fell from 2.0 to 1.0 and overfits back up to
1.3 did in mode ``"min"``); and the metric
moved the other way steadily (Kendall's tau of the readings against their order at
least ``TREND`` in the direction the mode calls worse, over at least ``READINGS``
readings). A healthy plateau schedule sees its metric improve before it flattens,
and a flat or noisy metric has no steady trend; a loss that rises from the very
first evaluation (a model that overfits from the start) is told apart only in the
words: the finding says both.

How: the class's ``step`` is wrapped (``_torch_compat.wrap_plateau_steps``), so a
scheduler built before or after ``watch`` is seen; only schedulers of the watched
optimizer count. It reads one float per evaluation and nothing per training step.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional

from .. import _torch_compat, wire
from .._log import swallow

# Lr cuts before it is said.
CUTS = 2
# Readings of the metric needed for a trend.
READINGS = 4
# Kendall's tau, in the direction the mode calls worse, that makes a trend steady.
TREND = 0.6
# Readings kept per scheduler (the trend is judged over the latest).
KEPT = 64
# An improvement on the first reading smaller than this share of the metric's
# movement the other way since is the jitter of the first evaluations.
NOISE = 0.05


class _Readings:
    def __init__(self) -> None:
        self.said = False
        self.first: Optional[float] = None
        self.values: List[float] = []
        self.cuts = 0
        # The most the metric has been better, and worse, than its first reading,
        # under the scheduler's mode.
        self.gain = 0.0
        self.loss = 0.0

    def improved(self) -> bool:
        return self.gain > NOISE * self.loss


class PlateauWatch:
    """Watches the ``ReduceLROnPlateau`` schedulers of ``optimizer``."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizers = [o for o in (optimizer, getattr(optimizer, "optimizer", None)) if o]
        self._readings: weakref.WeakKeyDictionary[Any, _Readings] = weakref.WeakKeyDictionary()
        self._found: List[wire.WiringFinding] = []
        self._restore: Optional[Any] = None
        if not self._optimizers:
            return
        try:
            self._restore = _torch_compat.wrap_plateau_steps(self._on_step)
        except Exception as exc:
            swallow("watching the plateau scheduler", exc)

    def remove(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def findings(self) -> List[wire.WiringFinding]:
        found, self._found = self._found, []
        return found

    def _on_step(self, scheduler: Any, metrics: Any, lrs_before: List[float]) -> None:
        try:
            optimizer = getattr(scheduler, "optimizer", None)
            if optimizer is None:
                return
            if not any(optimizer is o for o in self._optimizers):
                return
            value = float(metrics)
            if not math.isfinite(value):
                return
            mode = str(getattr(scheduler, "mode", "min"))
            readings = self._readings.get(scheduler)
            if readings is None:
                readings = self._readings[scheduler] = _Readings()
            if readings.said:
                return
            lrs = [float(g["lr"]) for g in optimizer.param_groups]
            if any(after < before for before, after in zip(lrs_before, lrs)):
                readings.cuts += 1
            worse = 1.0 if mode == "min" else -1.0  # the sign of a change the mode calls worse
            if readings.first is None:
                readings.first = value
            change = (value - readings.first) * worse  # > 0: worse than the first
            readings.gain = max(readings.gain, -change)
            readings.loss = max(readings.loss, change)
            readings.values = (readings.values + [value])[-KEPT:]
            if (
                readings.cuts >= CUTS
                and not readings.improved()
                and len(readings.values) >= READINGS
                and worse * _kendall_tau(readings.values) >= TREND
            ):
                readings.said = True
                finding: Dict[str, Any] = {
                    "kind": "plateau_mode_mismatch",
                    "module": "",
                    "attribute": mode,
                    "measured": readings.cuts,
                }
                self._found.append(finding)  # type: ignore[arg-type]
        except Exception as exc:
            swallow("watching the plateau scheduler", exc)


def _kendall_tau(values: List[float]) -> float:
    """Kendall's tau of `values` against their order: 1 when each reading is above
    every earlier one, -1 when below, near 0 without a trend."""
    pairs = concordant = 0
    for i, a in enumerate(values):
        for b in values[i + 1 :]:
            pairs += 1
            concordant += (b > a) - (b < a)
    return concordant / pairs if pairs else 0.0

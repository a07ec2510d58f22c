"""A step record from its numbers, with named pieces (no torch: a list stands in for
the device vector)."""

from __future__ import annotations

from gradflow.measurement.record import (
    Intended,
    LowPrecisionUpdate,
    ModuleAt,
    NormAt,
    NormStats,
    PendingStep,
    ScalerNumbers,
    Slots,
    UpdatesAt,
    width,
)


class Vector(list):
    def tolist(self):
        return list(self)


def test_every_piece_is_read_by_name_from_where_it_was_put():
    slots = Slots()
    values: list = []

    def put(*numbers: float) -> int:
        values.extend(numbers)
        return slots.take(len(numbers))

    loss = put(0.5)
    grad = put(3.0, float("inf"))  # two modules' gradient norms
    stats = put(*NormStats(update_sq=4.0, drift=0.25, mean=1.0))
    intended = put(*Intended(norm_sq=1.0, max_ulp=0.4, nonzero=10, rounded_away=7))
    scaler = put(*ScalerNumbers(scale=1024.0, growth_tracker=3.0, found_inf=1.0))
    low = put(*LowPrecisionUpdate(0.0, float("nan"), float("nan"), float("nan"), float("nan")))
    assert width(NormStats) == 3 and width(LowPrecisionUpdate) == 5
    pending = PendingStep(step=4, time=1.0, vector=Vector(values), loss_at=loss)
    pending.modules = [ModuleAt("a", [grad], 1, None), ModuleAt("b", [grad + 1], 1, None)]
    pending.norms = [NormAt("a.norm", None, stats, intended, 8)]
    pending.scaler_at = scaler
    pending.updates = UpdatesAt(["a.weight"], [16], low)
    record = pending.record()
    assert record["loss"] == 0.5
    assert record["modules"] == [
        {"module": "a", "grad_norm": 3.0, "hook_hits": 1},
        {"module": "b", "grad_norm": "Infinity", "hook_hits": 1},
    ]
    assert record["metrics"] == {"grad_nonfinite_modules": 1.0}
    assert record["params"] == [
        {
            "name": "a.norm",
            "update_norm": 2.0,
            "drift": 0.25,
            "mean": 1.0,
            "intended_update_norm": 1.0,
            "intended_update_max_ulp": 0.4,
            "intended_nonzero": 10,
            "rounded_away": 7,
        },
        {"name": "a.weight", "update_norm": 0.0},
    ]
    assert record["scaler"] == {
        "scale": 1024.0,
        "growth_tracker": 3,
        "found_inf": True,
        "step_skipped": True,
    }

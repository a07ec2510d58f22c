"""The instability signals of one watched run (protocol v1.8): which families it
measures, at which intervals, and their parts — the forward-pass hooks
(:mod:`gradflow.capture.forward_signals`) and Adam's state
(:mod:`gradflow.measurement.adam_state`) — driven by the steps of
:class:`gradflow.capture.instrument.Instruments`."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from torch import nn

from ..measurement import signal_modules
from ..measurement.adam_state import AdamState
from ..measurement.registration import Registry
from ..measurement.signal_modules import SignalModules
from ..measurement.signals import Schedule, SignalSettings, registration_signals
from ..measurement.step_signals import StepSignals
from .forward_signals import ForwardSignals


def measured_intervals(
    settings: SignalSettings, modules: SignalModules, adam_readable: bool
) -> Dict[str, int]:
    """Each family's interval where the run has something to measure it on (0: off)."""
    present = dict(modules.families(), adam=adam_readable)
    return {f: settings.interval(f) if present.get(f) else 0 for f in settings.intervals}


class InstabilitySignals:
    """Arms the forward hooks for each sampled step, reads Adam's state after a
    sampled optimizer step, and hands a reported step's signals over at ``gf.step``."""

    def __init__(
        self, registry: Registry, model: nn.Module, settings: SignalSettings, every: int
    ) -> None:
        self.modules = signal_modules.find(model, settings)
        self.adam = AdamState(registry)
        self.intervals = measured_intervals(settings, self.modules, self.adam.readable)
        self.schedule = Schedule(self.intervals, every)
        self.forward = ForwardSignals(self.modules, self.schedule)
        self._adam_taken: Optional[Any] = None

    def registration(self) -> Optional[Dict[str, int]]:
        """The registration's ``signals``."""
        return registration_signals(self.intervals)

    def arm(self, step: int) -> None:
        """Before step `step`'s forward passes."""
        self.forward.arm(step)

    def after_optimizer_step(self, step: int) -> None:
        if self.schedule.due("adam", step):
            self._adam_taken = self.adam.read()

    def take(self, batch_ids: Any, micro_losses: Optional[List[Any]]) -> StepSignals:
        """What this step measured (the hooks come off) and what gf.step was given."""
        adam, self._adam_taken = self._adam_taken, None
        return StepSignals(self.forward.take(), adam, batch_ids, micro_losses)

    def discard(self) -> None:
        """A step not reported: what it measured is dropped."""
        self._adam_taken = None
        self.forward.take()

    def rebuild(self) -> None:
        self.adam.rebuild()

    def remove(self) -> None:
        self.forward.remove()

"""A step's instability signals on their way into its vector: what the forward hooks
captured, Adam's state, the micro-batch losses and the batch ids ``gf.step`` was
given, placed as pieces of the step's one transfer (:mod:`gradflow.measurement.measure`)
and described for the record (:mod:`gradflow.measurement.signal_record`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch

from .adam_state import AdamTaken
from .signal_record import Captured, SignalsAt
from .vector import Piece


@dataclass
class ForwardTaken:
    """A step's forward-pass signals (taken by
    :class:`gradflow.capture.forward_signals.ForwardSignals`): one piece of the step's
    vector and what lies where in it."""

    piece: Piece
    captured: List[Captured]


@dataclass
class StepSignals:
    """What a step measured of the signals, and what ``gf.step`` was given."""

    forward: Optional[ForwardTaken] = None
    adam: Optional[AdamTaken] = None
    batch_ids: Any = None
    micro_losses: Optional[List[Any]] = None

    def empty(self) -> bool:
        return (
            self.forward is None
            and self.adam is None
            and self.batch_ids is None
            and not self.micro_losses
        )


def place(given: StepSignals, add: Callable[[Piece], int]) -> SignalsAt:
    """Adds the signals' pieces with `add` (which returns each piece's position) and
    says where they lie."""
    at = SignalsAt(batch_ids=_host_ids(given.batch_ids))
    if given.forward is not None:
        at.captured_base = add(given.forward.piece)
        at.captured = given.forward.captured
    if given.adam is not None:
        at.adam_at = add(given.adam.piece)
        at.adam_modules = given.adam.modules
    losses = _losses(given.micro_losses)
    if losses is not None:
        at.micro_losses_at = add(losses)
        at.micro_losses = int(losses.numel())
    return at


def _losses(micro: Optional[List[Any]]) -> Optional[torch.Tensor]:
    """The micro-batch losses as one f32 vector on their device (a tensor each, or
    numbers); None when there are none."""
    if not micro:
        return None
    tensors = [x for x in micro if isinstance(x, torch.Tensor)]
    if len(tensors) == len(micro):
        device = tensors[0].device
        return torch.stack([t.detach().float().mean().to(device) for t in tensors])
    return torch.tensor([float(x) for x in micro], dtype=torch.float32)


def _host_ids(ids: Any) -> Any:
    """Batch ids as kept for the reporter thread: a copy of a list, a tensor moved to
    the host without waiting (read once its step's copy has landed)."""
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        return ids.detach().to("cpu", non_blocking=True) if ids.device.type != "cpu" else ids
    if isinstance(ids, (str, bytes, int)):
        return [ids]
    return list(ids)

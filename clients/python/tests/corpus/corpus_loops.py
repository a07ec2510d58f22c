"""The plain loop of the corpus cases from other kinds of training, recording its
losses (the shared loop pieces are in corpus_support)."""

from __future__ import annotations

from itertools import repeat
from typing import Any, Callable, List, Optional, Tuple

import torch
from corpus_support import quickstart, train_step
from torch import nn


def fit(
    model: nn.Module,
    optimizer: Any,
    loss_of: Callable[[], torch.Tensor],
    steps: int,
    before: Optional[Callable[[int], None]] = None,
) -> Tuple[str, List[float]]:
    """The README's loop (zero_grad, `loss_of()`, backward, step; `before(i)` first)
    under the quickstart for `steps` steps: the run id and the losses."""
    losses: List[float] = []

    def recorded(_model: nn.Module, _batch: Any) -> torch.Tensor:
        loss = loss_of()
        losses.append(loss.item())
        return loss

    step = train_step(model, optimizer, recorded, repeat(None), before=before)
    return quickstart(model, optimizer, step, steps=steps), losses

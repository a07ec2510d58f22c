"""Corpus: gradients of exactly 0 whose cause the client sees itself. Backward reaches
every module, so nothing cut the graph; the zero comes from the loop, and the alert
must name it rather than masks, gates or dead units."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from corpus_support import (
    STUCK_WINDOW,
    Classifier,
    class_loss,
    expects,
    feature_batches,
    judge,
    moved,
    quickstart,
    seeded,
    snapshot,
    three_windows,
)

# Three times `grad_stuck_zero`'s window of 50 steps.
STEPS = three_windows(STUCK_WINDOW)


def clip_norm_to_zero(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.0)


def clip_value_to_zero(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.0)


@seeded
@pytest.mark.parametrize("clip", [clip_norm_to_zero, clip_value_to_zero])
@expects("grad_stuck_zero", ("embed", "hidden", "head"), "clipped_to_zero")
def test_gradients_clipped_with_a_limit_of_zero(
    request, gradflow_server, gradflow_env, seed: int, clip: Callable[[torch.nn.Module], None]
):
    """A clip limit of 0 (a config's "0 = no clipping" passed straight to torch):
    `clip_grad_norm_` multiplies every gradient by 0, `clip_grad_value_` clamps them
    to 0, the run trains nothing and raises nothing ("0 / 0.0: [0.0, 0.0] ...
    success ... 0 of 34,701 parameters moved").

    Threads: https://github.com/strands-labs/robots/pull/2028,
    https://github.com/OpenNMT/OpenNMT-py/issues/1140
    """
    model = Classifier(seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = feature_batches(16, 4, seed=seed + 1)
    before = snapshot(model)

    def step(i: int) -> torch.Tensor:
        optimizer.zero_grad()
        loss = class_loss(model, next(data))
        loss.backward()
        clip(model)
        optimizer.step()
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS)
    assert not moved(before, model)  # nothing trained
    alert = judge(request, gradflow_server, run_id)
    assert "max_norm=0" in alert["fix"], alert["fix"]

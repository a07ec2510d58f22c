"""A regression loss whose prediction and target broadcast (protocol v1.10's
`loss_broadcasts`), from pytorch/pytorch#16045: `MSELoss()(yhat, y)` with `yhat` of
shape (N, 1) and `y` of shape (N). Silent twins: the same fit with matching shapes,
a target broadcast over the prediction's extra dimension (no more pairs than
predictions), and a mismatched loss computed under `no_grad` (an evaluation)."""

from __future__ import annotations

import pytest
import torch
from conftest import new_run_id
from torch import nn

import gradflow
from gradflow.capture import loss_shapes


def fit(gradflow_server, loss_of, steps: int = 60):
    torch.manual_seed(0)
    x = torch.randn(100, 2)
    y = 10 + 9 * x[:, 0] - 2 * x[:, 1] + torch.randn(100)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    for _ in range(steps):
        loss = loss_of(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == steps
    return gf.run_id, model


def test_a_prediction_broadcast_against_its_target_is_named(gradflow_server):
    with pytest.warns(UserWarning, match="target size"):
        run_id, model = fit(gradflow_server, lambda m, x, y: nn.MSELoss()(m(x), y))
    assert model.weight.abs().max() < 1.0  # the slopes never found
    alert = gradflow_server.wait_for_alert(run_id, "loss_broadcasts", subject="loss")
    assert alert["severity"] == "critical"
    assert alert["evidence"]["attribute"] == "mse_loss: input (100, 1), target (100,)"
    assert alert["evidence"]["measured"] == 100
    assert [a["kind"] for a in gradflow_server.serious(run_id)] == ["loss_broadcasts"]


def test_matching_shapes_are_silent(gradflow_server):
    run_id, model = fit(gradflow_server, lambda m, x, y: nn.MSELoss()(m(x).squeeze(1), y))
    assert model.weight[0, 0] > 8.0  # it found the slope
    assert gradflow_server.serious(run_id) == []


def test_a_target_broadcast_over_an_extra_dimension_and_an_evaluation_are_silent(
    gradflow_server,
):
    def loss_of(model, x, y):
        with torch.no_grad():  # an evaluation with the broadcasting shapes: not training
            nn.functional.l1_loss(model(x), y)
        pred = model(x).expand(100, 4)  # (N, 4) against (N, 1): N * 4 pairs, no more
        return nn.functional.mse_loss(pred, y.unsqueeze(1))

    with pytest.warns(UserWarning, match="target size"):
        run_id, _ = fit(gradflow_server, loss_of)
    assert gradflow_server.serious(run_id) == []


def test_the_functionals_are_restored_after_the_first_calls(gradflow_server):
    original = nn.functional.mse_loss
    run_id, _ = fit(
        gradflow_server,
        lambda m, x, y: nn.functional.mse_loss(m(x).squeeze(1), y),
        steps=loss_shapes.CALLS + 5,
    )
    assert nn.functional.mse_loss is original
    assert gradflow_server.serious(run_id) == []

"""Several ``optimizer.step()`` calls between two ``gf.step()``: the client counts the
optimizer's steps per record (v1.9 ``optimizer_steps``) and the server says what the
loop does, instead of reading a gradient taken at one of those steps as "nothing is
updated" while the weights move.

The failure is thunlp/OpenPrompt#106's loop: gradient accumulation whose
``optimizer.step()`` sits outside the branch that ends the accumulation. With the
branch's own step and ``zero_grad`` kept, the extra step after it finds the gradients
just cleared, and the ones on the micro-batches before it step on partial sums. The
look-alike is the same model and data with the accumulation written right."""

from __future__ import annotations

from typing import List, Tuple

import torch
from conftest import new_run_id
from torch import nn

import gradflow

ACCUMULATE = 4
MICRO_BATCHES = 60 * ACCUMULATE


def model_and_optimizer() -> Tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.02)


def micro_batch(i: int) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(i)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(1, keepdim=True)


def train(server_url: str, step_outside_branch: bool) -> Tuple[str, List[float]]:
    model, optimizer = model_and_optimizer()
    gf = gradflow.watch(model, optimizer, server=server_url, run_id=new_run_id("accum"))
    losses: List[float] = []
    for i in range(MICRO_BATCHES):
        x, y = micro_batch(i)
        loss = (model(x) - y).square().mean()
        (loss / ACCUMULATE).backward()
        if (i + 1) % ACCUMULATE == 0:
            optimizer.step()
            optimizer.zero_grad()
            gf.step(loss=loss)
            losses.append(loss.item())
        if step_outside_branch:
            optimizer.step()  # the thread's extra step, on every micro-batch
    gf.close()
    return gf.run_id, losses


def settled_alerts(server, run_id: str) -> list:
    """The run's alerts once every step is stored (``gf.close`` flushed them)."""
    server.wait_for_steps(run_id, MICRO_BATCHES // ACCUMULATE)
    return server.alerts(run_id)


def test_an_extra_step_outside_the_accumulation_is_named_not_read_as_no_update(
    gradflow_server,
):
    run_id, losses = train(gradflow_server.url, step_outside_branch=True)
    assert losses[-1] < 0.2 * losses[0], "the weights move: the model trains"
    alerts = settled_alerts(gradflow_server, run_id)
    steps = [a for a in alerts if a["kind"] == "optimizer_steps_per_report"]
    assert len(steps) == 1, alerts
    alert = steps[0]
    assert alert["subject"] == "optimizer"
    assert alert["severity"] == "warning"
    assert alert["evidence"]["cause"] == "step_outside_accumulation"
    # Four micro-batches, each with its own step, and the branch's step: five.
    assert alert["evidence"]["optimizer_steps_max"] == ACCUMULATE + 1
    assert "accumulation" in alert["fix"]
    assert not [a for a in alerts if a["kind"] == "grad_stuck_zero"], alerts
    counts = {value for _, value in gradflow_server.series(run_id, "optimizer_steps")}
    assert counts == {ACCUMULATE, ACCUMULATE + 1}, counts


def test_accumulation_written_right_reports_one_step_and_stays_silent(gradflow_server):
    run_id, losses = train(gradflow_server.url, step_outside_branch=False)
    assert losses[-1] < 0.5 * losses[0], "training measurably progressed"
    alerts = settled_alerts(gradflow_server, run_id)
    assert alerts == [], alerts
    counts = {value for _, value in gradflow_server.series(run_id, "optimizer_steps")}
    assert counts == {1}, counts

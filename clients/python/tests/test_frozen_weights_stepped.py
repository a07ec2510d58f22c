"""Frozen weights that `optimizer.step()` changes anyway (protocol v1.10's
`frozen_weights_stepped`). From iamwangyabin/S-Prompts#2: the prompt pool of an
earlier task is frozen (`requires_grad=False`) but stays in the SGD optimizer, built
from all of the network's parameters, with weight decay and momentum; its gradient is
zeroed rather than set to None (`zero_grad()` before torch 2.0), so every step still
decays it ("the mean value of prompt_pool[0] ... was decreasing").

Healthy twins stay silent: the same loop clearing gradients to None (torch's
optimizers then skip the frozen pool), plain SGD without decay or momentum on the
zeroed gradient (the step touches the pool and changes nothing), and an EMA teacher
held by the optimizer with `requires_grad=False` and moved by hand after each step."""

from __future__ import annotations

import torch
from conftest import new_run_id
from torch import nn

import gradflow
from gradflow.capture import frozen_moves


class Prompted(nn.Module):
    """A prompt pool prepended to the input, a small encoder and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt = nn.Module()
        self.prompt.pool = nn.Parameter(torch.randn(4, 16) * 0.5)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x + self.prompt.pool.mean(0))
        return self.classifier(h)


def run(gradflow_server, *, set_to_none: bool, momentum: float, weight_decay: float):
    """Task 1 trains everything for 20 steps; task 2 freezes the pool and trains on
    for 110 steps with the same optimizer. Returns the run id and the pool at the
    freeze and at the end."""
    torch.manual_seed(0)
    model = Prompted()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay
    )
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    g = torch.Generator().manual_seed(1)
    frozen_at = None
    for step in range(130):
        if step == 20:  # task 2: the earlier task's prompts are frozen
            model.prompt.pool.requires_grad_(False)
            frozen_at = model.prompt.pool.detach().clone()
        x = torch.randn(16, 16, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == 130
    return gf.run_id, frozen_at, model.prompt.pool.detach().clone()


def test_a_frozen_prompt_pool_decayed_by_the_optimizer_is_named(gradflow_server):
    run_id, frozen_at, end = run(
        gradflow_server, set_to_none=False, momentum=0.9, weight_decay=5e-4
    )
    assert end.norm() < frozen_at.norm()  # the frozen pool decays, as in the thread
    alert = gradflow_server.wait_for_alert(run_id, "frozen_weights_stepped", subject="prompt")
    assert alert["severity"] == "warning"
    assert alert["evidence"]["attribute"] == "pool"
    assert alert["first_step"] <= 20 + frozen_moves.EVERY + 1
    assert [a["kind"] for a in gradflow_server.serious(run_id)] == ["frozen_weights_stepped"]


def test_gradients_set_to_none_leave_the_frozen_pool_alone_and_silent(gradflow_server):
    run_id, frozen_at, end = run(gradflow_server, set_to_none=True, momentum=0.9, weight_decay=5e-4)
    assert torch.equal(end, frozen_at)
    assert gradflow_server.serious(run_id) == []


def test_a_step_that_touches_the_pool_without_changing_it_is_silent(gradflow_server):
    run_id, frozen_at, end = run(gradflow_server, set_to_none=False, momentum=0.0, weight_decay=0.0)
    assert torch.equal(end, frozen_at)  # plain SGD on a zeroed gradient: p -= lr * 0
    assert gradflow_server.serious(run_id) == []


def test_an_ema_teacher_in_the_optimizer_moved_by_hand_is_silent(gradflow_server):
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    model = nn.ModuleDict({"student": student, "teacher": teacher})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    g = torch.Generator().manual_seed(1)
    start = [p.detach().clone() for p in teacher.parameters()]
    for _ in range(120):
        x = torch.randn(16, 16, generator=g)
        with torch.no_grad():
            target = teacher(x + 0.1 * torch.randn(16, 16, generator=g))
        loss = (student(x) - target).square().mean()
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        with torch.no_grad():  # the EMA update, by hand, outside the step
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.mul_(0.99).add_(s, alpha=0.01)
        gf.step(loss=loss)
    gf.close()
    assert not all(torch.equal(a, b) for a, b in zip(start, teacher.parameters()))
    assert gradflow_server.run(gf.run_id)["step_count"] == 120
    assert gradflow_server.serious(gf.run_id) == []

"""A model left computing in eval mode by a helper that switches its parts, not the
model itself (protocol v1.10's refinement of `model_training`). From
facebookresearch/clevr-iep#22: `check_accuracy` calls `set_mode('eval', [program
generator, execution engine])` and never `set_mode('train', ...)`, so after the first
check every dropout and batch norm of both parts runs in eval mode while the wrapper
that is watched keeps its own flag on. Silent twins: the same loop switching the
parts back, a frozen teacher kept in eval inside the wrapper while the student
trains, and batch norm frozen (eval) from the first step on purpose."""

from __future__ import annotations

from typing import List, Optional

import torch
from conftest import new_run_id
from torch import nn

import gradflow


def part() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2))


class Joint(nn.Module):
    """clevr-iep's two models trained together, held by one wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.program_generator = part()
        self.execution_engine = nn.Sequential(part(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.execution_engine[1](self.execution_engine[0](x) + self.program_generator(x))


def set_mode(mode: str, models: List[nn.Module]) -> None:
    """clevr-iep's `set_mode`."""
    for m in models:
        m.train() if mode == "train" else m.eval()


def train(
    gradflow_server,
    model: nn.Module,
    parts_back_to_train: bool,
    parts: Optional[List[nn.Module]] = None,
    steps: int = 120,
):
    torch.manual_seed(0)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    g = torch.Generator().manual_seed(1)
    parts = list(model.children()) if parts is None else parts
    for step in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
        if step % 20 == 19:  # check_accuracy
            set_mode("eval", parts)
            with torch.no_grad():
                model(torch.randn(64, 16, generator=g))
            if parts_back_to_train:
                set_mode("train", parts)
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == steps
    return gf.run_id


def test_parts_left_in_eval_by_a_check_are_named(gradflow_server):
    model = Joint()
    run_id = train(gradflow_server, model, parts_back_to_train=False)
    assert model.training and not any(m.training for m in model.children())
    alert = gradflow_server.wait_for_alert(run_id, "model_in_eval_mode", subject="model")
    assert alert["severity"] == "warning"
    assert alert["evidence"]["cause"] == "left_in_eval"
    assert [a["kind"] for a in gradflow_server.serious(run_id)] == ["model_in_eval_mode"]


def test_parts_switched_back_are_silent(gradflow_server):
    run_id = train(gradflow_server, Joint(), parts_back_to_train=True)
    assert gradflow_server.serious(run_id) == []


class Distilled(nn.Module):
    """A student beside a frozen teacher that stays in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(part(), nn.Linear(32, 4))
        self.teacher = nn.Sequential(part(), nn.Linear(32, 4)).eval().requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = self.teacher(x).softmax(-1)
        return self.student(x) + 0.0 * soft.sum()

    def train(self, mode: bool = True) -> Distilled:
        super().train(mode)
        self.teacher.eval()  # the teacher never trains
        return self


def test_a_teacher_kept_in_eval_beside_a_training_student_is_silent(gradflow_server):
    model = Distilled()
    run_id = train(gradflow_server, model, parts_back_to_train=True, parts=[model.student])
    assert model.student.training and not model.teacher.training
    assert gradflow_server.serious(run_id) == []


def test_batch_norm_frozen_from_the_first_step_is_silent(gradflow_server):
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    model[1].eval()  # frozen statistics, on purpose, before the first step
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gf = gradflow.watch(model, optimizer, server=gradflow_server.url, run_id=new_run_id())
    g = torch.Generator().manual_seed(1)
    for _ in range(80):
        x = torch.randn(32, 16, generator=g)
        loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gf.step(loss=loss)
    gf.close()
    assert gradflow_server.run(gf.run_id)["step_count"] == 80
    assert gradflow_server.serious(gf.run_id) == []

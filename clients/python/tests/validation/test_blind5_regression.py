"""Regression (the fifth set): a physics-informed network whose initial-condition
loss pairs a (batch, 1) prediction with a (batch,) target, and TabM's example loop,
which clips before `backward` under bf16 autocast.
"""

from __future__ import annotations

import math
from typing import List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, mean, watch

pytestmark = pytest.mark.validation


# -- Photon-AI-Research/NeuralSolvers#20: the initial condition's loss broadcasts -----


class PINN(nn.Module):
    """u(x, t) for the heat equation u_t = k u_xx on [-1, 1], a tanh MLP."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def initial_r_squared(model: PINN) -> float:
    x = torch.linspace(-1, 1, 201).unsqueeze(1)
    with torch.no_grad():
        u = model(torch.cat([x, torch.zeros_like(x)], 1)).squeeze(1)
    target = torch.sin(math.pi * x.squeeze(1))
    return 1 - ((u - target) ** 2).sum().item() / ((target - target.mean()) ** 2).sum().item()


def train_pinn(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """NeuralSolvers' PINN loss: the PDE residual on collocation points, the boundary
    condition u(+-1, t) = 0, and `InitialCondition`'s `MSELoss()(prediction, u0)` with
    the prediction (batch, 1) and u0 = sin(pi x) given as (batch,), as the thread's
    dataset yields it; Adam lr 1e-3, 64 points a term."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6500 + seed)
    model = PINN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mse = nn.MSELoss()
    run = watch(run_id, model, optimizer)
    k = 0.1
    for _ in range(steps):
        x0 = torch.rand(64, 1, generator=g) * 2 - 1
        u0 = torch.sin(math.pi * x0).squeeze(1)  # (64,)
        initial = mse(model(torch.cat([x0, torch.zeros_like(x0)], 1)), u0)
        xt = torch.rand(64, 2, generator=g) * torch.tensor([2.0, 1.0]) - torch.tensor([1.0, 0.0])
        xt.requires_grad_(True)
        u = model(xt)
        du = torch.autograd.grad(u.sum(), xt, create_graph=True)[0]
        u_xx = torch.autograd.grad(du[:, 0].sum(), xt, create_graph=True)[0][:, 0]
        pde = (du[:, 1] - k * u_xx).pow(2).mean()
        tb = torch.rand(64, 1, generator=g)
        xb = torch.where(torch.rand(64, 1, generator=g) < 0.5, -1.0, 1.0)
        boundary = model(torch.cat([xb, tb], 1)).pow(2).mean()
        loss = initial + pde + boundary
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"initial_r2": initial_r_squared(model)})


@pytest.mark.parametrize("seed", SEEDS)
def test_pinn_initial_condition_loss_broadcasts(gradflow_server, gradflow_env, seed):
    """https://github.com/Photon-AI-Research/NeuralSolvers/issues/20"""
    outcome = train_pinn(gradflow_env, seed)

    # Every prediction was compared with every target of the batch: the network fits
    # their mean and u(x, 0) misses sin(pi x).
    assert outcome.facts["initial_r2"] < 0.3, outcome.facts

    # The correct verdict (PROTOCOL: loss_broadcasts on `loss`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model", kind="loss_broadcasts", causes=("loss_broadcasts",), covers=("loss",)
        ),
    )


# -- yandex-research/tabm#20: the example clips before backward ------------------------


class TabMMini(nn.Module):
    """TabM-mini: k = 8 members sharing one MLP, each with its own input scaling
    (the only adapter of TabM-mini) and its own linear head."""

    def __init__(self, features: int = 12, hidden: int = 64, k: int = 8) -> None:
        super().__init__()
        self.k = k
        self.adapter = nn.Parameter(torch.ones(k, features) + 0.1 * torch.randn(k, features))
        self.backbone = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head_weight = nn.Parameter(torch.randn(k, hidden) / hidden**0.5)
        self.head_bias = nn.Parameter(torch.zeros(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x.unsqueeze(1) * self.adapter)  # (batch, k, hidden)
        return (h * self.head_weight).sum(-1) + self.head_bias  # (batch, k)


def tabular(size: int, g: torch.Generator, w: torch.Tensor):
    x = torch.randn(size, 12, generator=g)
    y = 3 * torch.sin(x @ w[:, 0]) + 2 * (x @ w[:, 1]).abs() + 0.1 * torch.randn(size, generator=g)
    return x, y


def train_tabm(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """TabM's example.ipynb: AdamW (lr 2e-3, weight decay 3e-4), batch 256, bf16
    autocast (no GradScaler), MSE over the k members' predictions, and
    `gradient_clipping_norm = 1.0` applied after `optimizer.zero_grad()` and before
    `loss.backward()`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6600 + seed)
    w = torch.randn(12, 2, generator=g) / 12**0.5
    model = TabMMini()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=3e-4)
    run = watch(run_id, model, optimizer)
    clipped_norms: List[float] = []
    used_norms: List[float] = []
    for _ in range(steps):
        x, y = tabular(256, g, w)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prediction = model(x).float()
        loss = F.mse_loss(prediction, y.unsqueeze(1).expand_as(prediction))
        clipped_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        loss.backward()
        used_norms.append(
            torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()])
            ).item()
        )
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "clip_found": max(clipped_norms),
            "share_above_bound": mean([float(n > 1.0) for n in used_norms]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_tabm_clips_before_backward(gradflow_server, gradflow_env, seed):
    """https://github.com/yandex-research/tabm/issues/20"""
    outcome = train_tabm(gradflow_env, seed)

    # The clip found no gradient at all (the norm it measured was 0 every time) while
    # a fifth of the steps or more used a gradient above its bound of 1.
    facts = outcome.facts
    assert facts["clip_found"] == 0.0, facts
    assert facts["share_above_bound"] > 0.15, facts

    # The correct verdict (PROTOCOL: clip_after_step on `gradients`, the clip before
    # the backward that wrote the gradients the step used).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model", kind="clip_after_step", causes=("clip_after_step",), covers=("gradients",)
        ),
    )

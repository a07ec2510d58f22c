"""Regression (the second set): a healthy rating model with sparse embeddings stepped
by SparseAdam, where each step touches a few rows of each table, and a healthy VAE
whose KL weight rises from 1e-7 to 0.5 so that its loss climbs for the whole run.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import (
    SEEDS,
    Outcome,
    assert_silent,
    mean,
    watch,
)

pytestmark = pytest.mark.validation

STEPS = 300


# -- pytorch#18404: sparse embeddings and SparseAdam ----------------------------------

USERS = 400
ITEMS = 600
RANK = 4


class MatrixFactorization(nn.Module):
    """Ratings as user . item + user bias + item bias, every table a sparse
    embedding (the thread's answer: `sparse=True` and SparseAdam)."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(USERS, 8, sparse=True)
        self.item = nn.Embedding(ITEMS, 8, sparse=True)
        self.user_bias = nn.Embedding(USERS, 1, sparse=True)
        self.item_bias = nn.Embedding(ITEMS, 1, sparse=True)
        for table in (self.user, self.item):
            nn.init.normal_(table.weight, std=0.1)
        for table in (self.user_bias, self.item_bias):
            nn.init.zeros_(table.weight)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        dot = (self.user(users) * self.item(items)).sum(1)
        return dot + self.user_bias(users).squeeze(1) + self.item_bias(items).squeeze(1)


def ratings(count: int, truth: tuple, g: torch.Generator) -> tuple:
    users = torch.randint(0, USERS, (count,), generator=g)
    items = torch.randint(0, ITEMS, (count,), generator=g)
    u, v = truth
    y = (u[users] * v[items]).sum(1) + 0.1 * torch.randn(count, generator=g)
    return users, items, y


def train_sparse_factorization(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """Rating regression (MSE) over 400 users and 600 items, batch 128, SparseAdam at
    0.05: each step's gradient is a sparse tensor over at most 128 rows of each
    table, out of 400 and 600."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1500 + seed)
    truth = (torch.randn(USERS, RANK, generator=g), torch.randn(ITEMS, RANK, generator=g))
    model = MatrixFactorization()
    optimizer = torch.optim.SparseAdam(list(model.parameters()), lr=0.05)
    held_out = ratings(2000, truth, g)

    def held_out_rmse() -> float:
        with torch.no_grad():
            return F.mse_loss(model(held_out[0], held_out[1]), held_out[2]).sqrt().item()

    before = held_out_rmse()
    run = watch(run_id, model, optimizer)
    touched_share = []
    sparse_steps = 0
    for _ in range(steps):
        users, items, y = ratings(128, truth, g)
        loss = F.mse_loss(model(users, items), y)
        optimizer.zero_grad()
        loss.backward()
        grad = model.item.weight.grad
        sparse_steps += grad.is_sparse
        touched_share.append(grad.coalesce().indices().shape[1] / ITEMS)
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "rmse_before": before,
            "rmse_after": held_out_rmse(),
            "sparse_steps": sparse_steps,
            "max_touched_share": max(touched_share),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_sparse_embeddings_with_sparse_adam(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/pytorch/issues/18404"""
    outcome = train_sparse_factorization(gradflow_env, seed)

    facts = outcome.facts
    # Alarming to a tool that reads dense gradients: every gradient is a sparse tensor,
    # and each step touches at most a fifth of the item rows ...
    assert facts["sparse_steps"] == STEPS, facts
    assert facts["max_touched_share"] < 0.25, facts
    # ... while the held-out error fell.
    assert facts["rmse_after"] < 0.8 * facts["rmse_before"], facts

    assert_silent(gradflow_server, outcome)


# -- LION#17: the KL weight rises, and the loss with it -------------------------------

DIM = 16


def manifold_batch(size: int, basis: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Points on a curved 2-D sheet in 16 dimensions, offset from the origin."""
    u = torch.rand(size, 2, generator=g) * 2 - 1
    coords = torch.cat([u, torch.sin(math.pi * u), u.prod(1, keepdim=True)], dim=1)
    return 2.0 + coords @ basis


class IdentityInitVAE(nn.Module):
    """A VAE initialised as the identity (LION's): the encoder's mean is the input
    plus a residual MLP whose last layer starts at zero, its log-variance starts very
    low, and the decoder is the latent plus a zero-initialised residual MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(DIM, 64), nn.SiLU(), nn.Linear(64, 2 * DIM))
        self.dec = nn.Sequential(nn.Linear(DIM, 64), nn.SiLU(), nn.Linear(64, DIM))
        for last in (self.enc[-1], self.dec[-1]):
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        self.enc[-1].bias.data[DIM:] = -10.0

    def encode(self, x: torch.Tensor) -> tuple:
        out = self.enc(x)
        return x + out[:, :DIM], out[:, DIM:]

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.dec(z)

    def forward(self, x: torch.Tensor) -> tuple:
        mu, logvar = self.encode(x)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon = F.mse_loss(self.decode(z), x, reduction="none").sum(1).mean()
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).sum(1).mean()
        return recon, kl


def train_annealed_vae(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """LION's VAE schedule, shortened: the KL weight rises linearly from 1e-7 to 0.5
    over the run, Adam at 1e-3, batch 64. At first the identity reconstructs
    perfectly and the KL term weighs nothing; as the weight grows the loss climbs."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1600 + seed)
    basis = torch.randn(5, DIM, generator=g) / math.sqrt(5)
    model = IdentityInitVAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = manifold_batch(512, basis, g)
    # The data's total variance: the error of predicting its mean.
    spread = torch.cdist(probe, probe).pow(2).mean().item() / 2

    def probe_terms() -> tuple:
        """The KL term and the reconstruction error on a probe batch."""
        with torch.no_grad():
            recon, kl = model(probe)
        return kl.item(), recon.item()

    kl_before, _ = probe_terms()
    run = watch(run_id, model, optimizer)
    losses = []
    for step in range(steps):
        kl_weight = 1e-7 + (0.5 - 1e-7) * step / (steps - 1)
        recon, kl = model(manifold_batch(64, basis, g))
        loss = recon + kl_weight * kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "loss_early": mean(losses[:20]),
            "loss_late": mean(losses[-20:]),
            "kl_before": kl_before,
            "kl_after": probe_terms()[0],
            "recon_after": probe_terms()[1],
            "data_spread": spread,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_vae_loss_climbs_with_the_kl_weight(gradflow_server, gradflow_env, seed):
    """https://github.com/nv-tlabs/LION/issues/17"""
    outcome = train_annealed_vae(gradflow_env, seed)

    facts = outcome.facts
    # Alarming: the loss ends several times above where it started ...
    assert facts["loss_late"] > 3 * facts["loss_early"], facts
    # ... while the posterior moved toward the prior (the KL term fell by more than
    # half) and the reconstructions still beat predicting the data's mean (whose
    # error is the data's total variance).
    assert facts["kl_after"] < 0.5 * facts["kl_before"], facts
    assert facts["recon_after"] < 0.8 * facts["data_spread"], facts

    assert_silent(gradflow_server, outcome)

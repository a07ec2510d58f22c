"""Generative models (the fourth set): CADA-VAE's two aligned VAEs, whose loss climbs
fast once the cross-reconstruction and distribution-alignment terms are switched on
by their warm-up schedules.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, assert_silent, mean, watch

pytestmark = pytest.mark.validation

CLASSES, FEATURES, ATTRIBUTES, LATENT = 6, 32, 8, 4


class VAE(nn.Module):
    """One of CADA-VAE's modality VAEs: an MLP encoder to a mean and a log-variance,
    an MLP decoder."""

    def __init__(self, dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.mu = nn.Linear(hidden, LATENT)
        self.logvar = nn.Linear(hidden, LATENT)
        self.decoder = nn.Sequential(nn.Linear(LATENT, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def encode(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        return self.mu(h), self.logvar(h)


def ramp(step: int, start: int, end: int, top: float) -> float:
    """CADA-VAE's warm-up: 0 before `start`, rising linearly to `top` at `end`."""
    return top * min(max((step - start) / (end - start), 0.0), 1.0)


def train_cada_vae(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """CADA-VAE's `vaemodel.py` in small: an image-feature VAE and an attribute VAE
    trained by one Adam (lr 1.5e-4 scaled to 3e-3 for the tiny nets, amsgrad) on
    L1 reconstruction, a KL term (beta 0 to 0.25 over the run), a cross-reconstruction
    term (each decoder from the other modality's latent; delta 0 to 1 between steps
    60 and 100) and a distribution alignment term (the 2-Wasserstein distance of the
    two latents; gamma 0 to 1 between steps 100 and 200), each summed over the batch
    of 50 as the repository does."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5000 + seed)
    class_attributes = torch.rand(CLASSES, ATTRIBUTES, generator=g)
    mixing = torch.randn(ATTRIBUTES, FEATURES, generator=g)
    model = nn.ModuleDict({"image": VAE(FEATURES), "attribute": VAE(ATTRIBUTES)})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003, amsgrad=True)
    run = watch(run_id, model, optimizer)

    def batch(size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, CLASSES, (size,), generator=g)
        a = class_attributes[labels]
        x = torch.relu(a @ mixing) + 0.1 * torch.randn(size, FEATURES, generator=g)
        return x, a

    def cross_error() -> float:
        x, a = batch(500)
        with torch.no_grad():
            mu_a, _ = model["attribute"].encode(a)
            return F.l1_loss(model["image"].decoder(mu_a), x).item()

    losses, cross_at_switch = [], 0.0
    for step in range(steps):
        x, a = batch(50)
        mu_x, logvar_x = model["image"].encode(x)
        mu_a, logvar_a = model["attribute"].encode(a)
        z_x = mu_x + torch.randn_like(mu_x) * torch.exp(0.5 * logvar_x)
        z_a = mu_a + torch.randn_like(mu_a) * torch.exp(0.5 * logvar_a)
        reconstruction = F.l1_loss(model["image"].decoder(z_x), x, reduction="sum") + F.l1_loss(
            model["attribute"].decoder(z_a), a, reduction="sum"
        )
        cross = F.l1_loss(model["image"].decoder(z_a), x, reduction="sum") + F.l1_loss(
            model["attribute"].decoder(z_x), a, reduction="sum"
        )
        kl = -0.5 * torch.sum(1 + logvar_x - mu_x**2 - logvar_x.exp()) - 0.5 * torch.sum(
            1 + logvar_a - mu_a**2 - logvar_a.exp()
        )
        wasserstein = torch.sqrt(
            ((mu_x - mu_a) ** 2).sum(1)
            + ((torch.exp(0.5 * logvar_x) - torch.exp(0.5 * logvar_a)) ** 2).sum(1)
        ).sum()
        loss = (
            reconstruction
            + ramp(step, 0, steps, 0.25) * kl
            + ramp(step, 60, 100, 1.0) * cross
            + ramp(step, 100, 200, 1.0) * wasserstein
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
        if step == 60:
            cross_at_switch = cross_error()
    run.close()
    return Outcome(
        {"model": run},
        {
            "loss_before": mean(losses[50:60]),
            "loss_peak": max(mean(losses[i : i + 10]) for i in range(60, steps, 10)),
            "cross_at_switch": cross_at_switch,
            "cross_end": cross_error(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_cada_vae_loss_climbs_when_alignment_terms_switch_on(gradflow_server, gradflow_env, seed):
    """https://github.com/sbharadwajj/Generalized-Zero-Shot-Learning-via-Aligned-Variational-Autoencoders/issues/1"""
    outcome = train_cada_vae(gradflow_env, seed)

    # The loss climbs well above where it stood before the switch, and the aligned latents
    # learned what they are for: an image feature decoded from its class's
    # attributes is far closer to the real one than when the term switched on.
    facts = outcome.facts
    assert facts["loss_peak"] > 1.2 * facts["loss_before"], facts
    assert facts["cross_end"] < 0.7 * facts["cross_at_switch"], facts

    # The correct verdict: a healthy run whose objective grows by design.
    assert_silent(gradflow_server, outcome)

"""GANs (the second set): a healthy WGAN-GP whose critic and generator losses are
negative, as Wasserstein losses are.

Each network has its own optimizer and is watched as its own run (`run_id=` tells
them apart). The images are 8x8 strokes on a dark background, four kinds, in [-1, 1].
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .support import (
    SEEDS,
    Outcome,
    assert_silent,
    mean,
    watch,
)
from .test_validation_gan import SIDE, distance_to_data, real_batch

pytestmark = pytest.mark.validation

PIXELS = SIDE * SIDE
STEPS = 300


def gradient_penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    alpha = torch.rand(len(real), 1)
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    grads = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)[0]
    return ((grads.norm(2, dim=1) - 1) ** 2).mean()


# -- Kinetic-GAN#1: negative losses in a WGAN-GP --------------------------------------


def train_wgan_gp(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """Kinetic-GAN's loop (after PyTorch-GAN's WGAN-GP): Adam lr 2e-4, betas (0.5,
    0.999), n_critic 5, lambda_gp 10; the critic loss `-mean(D(real)) +
    mean(D(fake)) + 10 * gp`, the generator loss `-mean(D(fake))`. Batch 64, latent 16,
    MLP networks for 8x8 images."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1400 + seed)
    latent, batch = 16, 64
    generator = nn.Sequential(
        nn.Linear(latent, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, PIXELS),
        nn.Tanh(),
    )
    critic = nn.Sequential(
        nn.Linear(PIXELS, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 64),
        nn.LeakyReLU(0.2),
        nn.Linear(64, 1),
    )
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(critic.parameters(), lr=2e-4, betas=(0.5, 0.999))
    probe = torch.randn(512, latent, generator=g)
    with torch.no_grad():
        before = distance_to_data(generator(probe))
    runs = {
        "critic": watch(f"{run_id}-critic", critic, opt_d),
        "generator": watch(f"{run_id}-generator", generator, opt_g),
    }
    d_losses, g_losses = [], []
    for _ in range(steps):
        for _ in range(5):
            real = real_batch(batch, g)
            fake = generator(torch.randn(batch, latent, generator=g)).detach()
            opt_d.zero_grad()
            d_loss = (
                -critic(real).mean()
                + critic(fake).mean()
                + 10 * gradient_penalty(critic, real, fake)
            )
            d_loss.backward()
            opt_d.step()
            runs["critic"].step(d_loss)
            d_losses.append(d_loss.item())
        opt_g.zero_grad()
        g_loss = -critic(generator(torch.randn(batch, latent, generator=g))).mean()
        g_loss.backward()
        opt_g.step()
        runs["generator"].step(g_loss)
        g_losses.append(g_loss.item())
    for run in runs.values():
        run.close()
    with torch.no_grad():
        after = distance_to_data(generator(probe))
    return Outcome(
        runs,
        {
            "distance_before": before,
            "distance_after": after,
            "critic_negative_share": sum(1 for v in d_losses[50:] if v < 0) / len(d_losses[50:]),
            "critic_loss_late": mean(d_losses[-100:]),
            "generator_loss_range": (min(g_losses), max(g_losses)),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_wgan_gp_losses_are_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/DegardinBruno/Kinetic-GAN/issues/1"""
    outcome = train_wgan_gp(gradflow_env, seed)

    facts = outcome.facts
    # Alarming: the critic's loss is negative on nearly every step ...
    assert facts["critic_negative_share"] > 0.9, facts
    assert facts["critic_loss_late"] < 0, facts
    # ... while the generator's samples moved toward the data.
    assert facts["distance_after"] < 0.8 * facts["distance_before"], facts

    assert_silent(gradflow_server, outcome)

"""GANs (the second set): a GAN whose generator step calls the discriminator's
optimizer (a typo in a course's template), and a healthy WGAN-GP whose critic loss is
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
    Diagnosis,
    Outcome,
    assert_caught,
    assert_silent,
    mean,
    snapshot,
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


# -- npfl138#57: the generator's step uses the discriminator's optimizer --------------


def train_gan_with_swapped_optimizer(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """The course's GAN as the template's typo had students write it: Adam (default
    lr 1e-3) for each network, BCE, batch 50, one hidden layer of 128 in each, sigmoid
    outputs, images in [0, 1], latent 100. The generator's update calls
    `self.optimizer["discriminator"].step()`: the generator never steps, and the
    discriminator steps twice, once on the generator's loss."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1800 + seed)
    latent, batch = 100, 50
    generator = nn.Sequential(
        nn.Linear(latent, 128), nn.ReLU(), nn.Linear(128, PIXELS), nn.Sigmoid()
    )
    discriminator = nn.Sequential(
        nn.Linear(PIXELS, 128), nn.ReLU(), nn.Linear(128, 1), nn.Sigmoid()
    )
    optimizer = {
        "generator": torch.optim.Adam(generator.parameters()),
        "discriminator": torch.optim.Adam(discriminator.parameters()),
    }
    bce = nn.BCELoss()
    probe = torch.randn(512, latent, generator=g)
    with torch.no_grad():
        before = distance_to_data(2 * generator(probe) - 1)
    generator_before = snapshot(generator)
    discriminator_before = snapshot(discriminator)
    runs = {
        "generator": watch(f"{run_id}-generator", generator, optimizer["generator"]),
        "discriminator": watch(
            f"{run_id}-discriminator", discriminator, optimizer["discriminator"]
        ),
    }
    for _ in range(steps):
        images = (real_batch(batch, g) + 1) / 2
        optimizer["generator"].zero_grad()
        fake = generator(torch.randn(batch, latent, generator=g))
        generator_loss = bce(discriminator(fake), torch.ones(batch, 1))
        generator_loss.backward()
        optimizer["discriminator"].step()
        runs["generator"].step(generator_loss)

        optimizer["discriminator"].zero_grad()
        discriminated_real = discriminator(images)
        discriminated_fake = discriminator(fake.detach())
        discriminator_loss = bce(discriminated_real, torch.ones(batch, 1)) + bce(
            discriminated_fake, torch.zeros(batch, 1)
        )
        discriminator_loss.backward()
        optimizer["discriminator"].step()
        runs["discriminator"].step(discriminator_loss)
    for run in runs.values():
        run.close()
    with torch.no_grad():
        after = distance_to_data(2 * generator(probe) - 1)
    now_g = dict(generator.named_parameters())
    now_d = dict(discriminator.named_parameters())
    return Outcome(
        runs,
        {
            "generator_moved": [
                n for n, v in generator_before.items() if not torch.equal(now_g[n], v)
            ],
            "discriminator_moved": len(
                [n for n, v in discriminator_before.items() if not torch.equal(now_d[n], v)]
            ),
            "distance_before": before,
            "distance_after": after,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_gan_generator_stepped_with_the_discriminator_optimizer(
    gradflow_server, gradflow_env, seed
):
    """https://github.com/ufal/npfl138/issues/57"""
    outcome = train_gan_with_swapped_optimizer(gradflow_env, seed)

    facts = outcome.facts
    # The generator never changed and its samples are as far from the data as at
    # the start; the discriminator trained.
    assert facts["generator_moved"] == [], facts
    assert facts["distance_after"] == facts["distance_before"], facts
    assert facts["discriminator_moved"] == 4, facts

    # The correct verdict: backward reaches the generator and its own optimizer never
    # steps (PROTOCOL: optimizer_not_stepped, cause never_stepped, on the generator's
    # run). The discriminator's extra step on the generator's loss is the same typo's
    # other face; the finding a user needs is the generator's.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="generator", kind="optimizer_not_stepped", causes=("never_stepped",)),
    )

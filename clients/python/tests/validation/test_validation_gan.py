"""GANs: a discriminator whose gradients are never zeroed, and a healthy GAN whose
generator loss climbs while its samples approach the data.

Each network has its own optimizer, so each is watched as its own run, as a user of
the quickstart with two models and two optimizers would (`run_id=` tells them apart).
The images are 8x8 strokes on a dark background, four kinds, scaled to [-1, 1] as
the threads' MNIST loaders scale them.
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
    watch,
)

pytestmark = pytest.mark.validation

SIDE = 8
PIXELS = SIDE * SIDE
STEPS = 300


def prototypes() -> torch.Tensor:
    """Four 8x8 stroke images in {-1, 1}: a row, a column, a diagonal, a frame."""
    images = -torch.ones(4, SIDE, SIDE)
    images[0, 3:5, :] = 1
    images[1, :, 3:5] = 1
    images[2] = torch.where(torch.eye(SIDE) > 0, 1.0, -1.0)
    images[3, 0, :] = images[3, -1, :] = images[3, :, 0] = images[3, :, -1] = 1
    return images.reshape(4, PIXELS)


PROTOTYPES = prototypes()


def real_batch(size: int, g: torch.Generator) -> torch.Tensor:
    kinds = torch.randint(0, len(PROTOTYPES), (size,), generator=g)
    return (PROTOTYPES[kinds] + 0.2 * torch.randn(size, PIXELS, generator=g)).clamp(-1, 1)


def distance_to_data(samples: torch.Tensor) -> float:
    """Root-mean-square distance of each sample to its nearest stroke image, averaged:
    about 1 for a generator that outputs grey, near 0.2 for one that draws strokes."""
    gaps = torch.cdist(samples, PROTOTYPES) / PIXELS**0.5
    return gaps.min(dim=1).values.mean().item()


# -- code-soup: the discriminator's gradients are never zeroed ------------------------


class CodeSoupGenerator(nn.Module):
    """code-soup's `Generator`: an MLP with LeakyReLU and a Tanh output, holding its
    own Adam optimizer (sizes shrunk: latent 16 instead of 128, an 8x8 image)."""

    def __init__(self, latent: int, lr: float) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(latent, 64),
            nn.LeakyReLU(0.2),
            nn.Linear(64, 128),
            nn.LeakyReLU(0.2),
            nn.Linear(128, PIXELS),
            nn.Tanh(),
        )
        self.optimizer = torch.optim.Adam(self.parameters(), lr=lr)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class CodeSoupDiscriminator(nn.Module):
    """code-soup's `Discriminator`: LeakyReLU, Dropout(0.3), a Sigmoid output."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(PIXELS, 128),
            nn.LeakyReLU(0.2),
            nn.Dropout(0.3),
            nn.Linear(128, 64),
            nn.LeakyReLU(0.2),
            nn.Dropout(0.3),
            nn.Linear(64, 1),
            nn.Sigmoid(),
        )
        self.optimizer = torch.optim.Adam(self.parameters(), lr=lr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def train_code_soup_gan(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """code-soup's `GAN.step` as the thread found it (Adam lr 2e-4, batch 64, BCE):
    `self.discriminator.zero_grad()` is missing, so every backward pass adds to the
    discriminator's gradients for good, including the generator step's."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(100 + seed)
    latent, batch = 16, 64
    generator = CodeSoupGenerator(latent, lr=0.0002)
    discriminator = CodeSoupDiscriminator(lr=0.0002)
    criterion = nn.BCELoss()
    runs = {
        "discriminator": watch(f"{run_id}-discriminator", discriminator, discriminator.optimizer),
        "generator": watch(f"{run_id}-generator", generator, generator.optimizer),
    }
    last = discriminator.main[-2].weight
    growth = []
    for _ in range(steps):
        real = real_batch(batch, g)
        label = torch.ones(batch)
        err_real = criterion(discriminator(real).view(-1), label)
        err_real.backward()
        fake = generator(torch.randn(batch, latent, generator=g))
        label = torch.zeros(batch)
        err_fake = criterion(discriminator(fake.detach()).view(-1), label)
        err_fake.backward()
        discriminator.optimizer.step()
        runs["discriminator"].step(err_real + err_fake)
        growth.append(last.grad.norm().item())

        generator.zero_grad()
        err_g = criterion(discriminator(fake).view(-1), torch.ones(batch))
        err_g.backward()
        generator.optimizer.step()
        runs["generator"].step(err_g)
    for run in runs.values():
        run.close()

    # The gradient one fresh discriminator step would have, for comparison.
    stale = last.grad.detach().clone()
    discriminator.zero_grad()
    real = real_batch(batch, g)
    fake = generator(torch.randn(batch, latent, generator=g)).detach()
    fresh_loss = criterion(discriminator(real).view(-1), torch.ones(batch)) + criterion(
        discriminator(fake).view(-1), torch.zeros(batch)
    )
    fresh_loss.backward()
    return Outcome(
        runs,
        {
            "stale_norm": stale.norm().item(),
            "fresh_norm": last.grad.norm().item(),
            "early_norm": mean(growth[:10]),
            "late_norm": mean(growth[-10:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_gan_discriminator_never_zeroed(gradflow_server, gradflow_env, seed):
    """https://github.com/Adversarial-Deep-Learning/code-soup/issues/69"""
    outcome = train_code_soup_gan(gradflow_env, seed)

    facts = outcome.facts
    # The discriminator steps on the sum of every gradient it ever received.
    assert facts["late_norm"] > 5 * facts["early_norm"], facts
    assert facts["stale_norm"] > 5 * facts["fresh_norm"], facts

    # The correct verdict: the discriminator's gradients carry over from one optimizer
    # step to the next (PROTOCOL: grads_not_zeroed, cause not_zeroed). Its subject is
    # the run's own; the run is the discriminator's.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="discriminator", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )


# -- a healthy GAN whose generator loss rises ------------------------------------------


def train_healthy_gan(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """The thread's GAN (Adam at its default lr 1e-3 for both networks, batch 16, a
    generator with batch norm, the non-saturating generator loss) written as PyTorch's
    DCGAN example writes the loop: `netD.zero_grad()` before the discriminator's
    backward passes, `netG.zero_grad()` before the generator's, whose backward also
    runs through the discriminator."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(200 + seed)
    latent, batch = 16, 16
    net_g = nn.Sequential(
        nn.Linear(latent, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Linear(128, PIXELS),
        nn.Tanh(),
    )
    net_d = nn.Sequential(nn.Linear(PIXELS, 32), nn.ReLU(), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-3)
    criterion = nn.BCEWithLogitsLoss()
    probe = torch.randn(512, latent, generator=g)
    net_g.eval()
    with torch.no_grad():
        before = distance_to_data(net_g(probe))
    net_g.train()

    runs = {
        "discriminator": watch(f"{run_id}-discriminator", net_d, opt_d),
        "generator": watch(f"{run_id}-generator", net_g, opt_g),
    }
    g_losses = []
    for _ in range(steps):
        net_d.zero_grad()
        err_real = criterion(net_d(real_batch(batch, g)).view(-1), torch.ones(batch))
        err_real.backward()
        fake = net_g(torch.randn(batch, latent, generator=g))
        err_fake = criterion(net_d(fake.detach()).view(-1), torch.zeros(batch))
        err_fake.backward()
        opt_d.step()
        runs["discriminator"].step(err_real + err_fake)

        net_g.zero_grad()
        err_g = criterion(net_d(fake).view(-1), torch.ones(batch))
        err_g.backward()
        opt_g.step()
        runs["generator"].step(err_g)
        g_losses.append(err_g.item())
    for run in runs.values():
        run.close()
    net_g.eval()
    with torch.no_grad():
        after = distance_to_data(net_g(probe))
    return Outcome(
        runs,
        {
            "distance_before": before,
            "distance_after": after,
            "g_loss_early": mean(g_losses[:20]),
            "g_loss_late": mean(g_losses[-50:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_gan_generator_loss_rises_while_it_learns(gradflow_server, gradflow_env, seed):
    """https://github.com/uclaacmai/Generative-Adversarial-Network-Tutorial/issues/4"""
    outcome = train_healthy_gan(gradflow_env, seed)

    facts = outcome.facts
    # Alarming: the generator's loss ends well above where it started ...
    assert facts["g_loss_late"] > 1.5 * facts["g_loss_early"], facts
    # ... while its samples moved toward the data.
    assert facts["distance_after"] < 0.85 * facts["distance_before"], facts

    assert_silent(gradflow_server, outcome)

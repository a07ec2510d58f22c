"""GANs (the fourth set): GANalyze's latent-space transformer, trained through a fixed
generator and assessor without ever zeroing its gradients, and PyTorch-GAN's vanilla
GAN, whose generator loss climbs while the discriminator's settles and the samples
approach the data.

Each trained network is watched as its own run with its own optimizer. The images
are the first set's 8x8 strokes, scaled to [-1, 1].
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, watch
from .test_validation_gan import PIXELS, distance_to_data, real_batch

pytestmark = pytest.mark.validation

STEPS = 300


# -- LoreGoetschalckx/GANalyze#7: the transformer's gradients are never zeroed ------


class OneDirection(nn.Module):
    """GANalyze's transformer: moves a latent vector along one learned direction by
    `alpha`, the change of the assessor's score it should produce."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, z: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return z + alpha[:, None] * self.w


def frozen(module: nn.Module) -> nn.Module:
    module.requires_grad_(False)
    return module.eval()


def train_ganalyze(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """GANalyze's `train_pytorch.py` as the thread read it: a fixed generator (here an
    MLP from a 16-d latent to an 8x8 image) and a fixed assessor (an MLP scoring the
    image, MemNet's place) are not trained; the transformer learns a direction that
    changes the score by `alpha`, with an MSE loss between the assessor's score of the
    moved image and the original score plus `alpha` (Adam 2e-4 as the repository,
    batch 32, alpha uniform in [-0.5, 0.5]). `optimizer.zero_grad()` is never called:
    every step uses the sum of every gradient so far."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4400 + seed)
    latent, batch = 16, 32
    generator = frozen(nn.Sequential(nn.Linear(latent, 64), nn.ReLU(), nn.Linear(64, PIXELS)))
    assessor = frozen(nn.Sequential(nn.Linear(PIXELS, 32), nn.Tanh(), nn.Linear(32, 1)))
    transformer = OneDirection(latent)
    optimizer = torch.optim.Adam(transformer.parameters(), lr=0.0002)
    run = watch(run_id, transformer, optimizer)

    def loss_of(z: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        target = assessor(torch.tanh(generator(z))).squeeze(1) + alpha
        moved = assessor(torch.tanh(generator(transformer(z, alpha)))).squeeze(1)
        return ((moved - target) ** 2).mean()

    grad_norms = []
    for _ in range(steps):
        z = torch.randn(batch, latent, generator=g)
        alpha = torch.rand(batch, generator=g) - 0.5
        loss = loss_of(z, alpha)
        loss.backward()  # no optimizer.zero_grad() anywhere in the loop
        optimizer.step()
        grad_norms.append(transformer.w.grad.norm().item())
        run.step(loss)
    run.close()

    # One step's own gradient at the end, for comparison with what the step used.
    stale = transformer.w.grad.norm().item()
    transformer.w.grad = None
    z = torch.randn(256, latent, generator=g)
    loss_of(z, torch.rand(256, generator=g) - 0.5).backward()
    return Outcome(
        {"transformer": run},
        {
            "stale_norm": stale,
            "fresh_norm": transformer.w.grad.norm().item(),
            "early_norm": mean(grad_norms[:10]),
            "late_norm": mean(grad_norms[-10:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_ganalyze_transformer_never_zeroed(gradflow_server, gradflow_env, seed):
    """https://github.com/LoreGoetschalckx/GANalyze/issues/7"""
    outcome = train_ganalyze(gradflow_env, seed)

    # The gradient the last step used is the pile of 300 steps' gradients, far larger
    # than one step's own, and it kept growing over the run.
    facts = outcome.facts
    assert facts["stale_norm"] > 10 * facts["fresh_norm"], facts
    assert facts["late_norm"] > 5 * facts["early_norm"], facts

    # The correct verdict: the gradients are carried over from step to step (PROTOCOL:
    # grads_not_zeroed, cause not_zeroed).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="transformer", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )


# -- eriklindernoren/PyTorch-GAN#132: the generator loss climbs, the GAN learns -------


def block(cin: int, cout: int, normalize: bool = True) -> list:
    layers: list = [nn.Linear(cin, cout)]
    if normalize:
        layers.append(nn.BatchNorm1d(cout, 0.8))
    layers.append(nn.LeakyReLU(0.2))
    return layers


def train_pytorch_gan(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """PyTorch-GAN's `implementations/gan/gan.py` in small: the generator's blocks
    with `BatchNorm1d(out, 0.8)` and LeakyReLU 0.2, a tanh image; the discriminator's
    LeakyReLU MLP with a sigmoid; BCE; Adam 2e-4 with betas (0.5, 0.999) for both;
    the generator steps first on every batch, then the discriminator on the real
    batch and the detached fakes (batch 64, latent 16)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4450 + seed)
    latent, batch = 16, 64
    generator = nn.Sequential(
        *block(latent, 64, normalize=False), *block(64, 128), nn.Linear(128, PIXELS), nn.Tanh()
    )
    discriminator = nn.Sequential(
        nn.Linear(PIXELS, 64),
        nn.LeakyReLU(0.2),
        nn.Linear(64, 32),
        nn.LeakyReLU(0.2),
        nn.Linear(32, 1),
        nn.Sigmoid(),
    )
    adversarial = nn.BCELoss()
    opt_g = torch.optim.Adam(generator.parameters(), lr=0.0002, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=0.0002, betas=(0.5, 0.999))
    runs = {
        "generator": watch(f"{run_id}-generator", generator, opt_g),
        "discriminator": watch(f"{run_id}-discriminator", discriminator, opt_d),
    }

    def samples() -> torch.Tensor:
        generator.eval()
        with torch.no_grad():
            out = generator(torch.randn(512, latent, generator=g))
        generator.train()
        return out

    start = distance_to_data(samples())
    g_losses, d_losses = [], []
    for _ in range(steps):
        real = real_batch(batch, g)
        valid, fake = torch.ones(batch, 1), torch.zeros(batch, 1)

        opt_g.zero_grad()
        gen_imgs = generator(torch.randn(batch, latent, generator=g))
        g_loss = adversarial(discriminator(gen_imgs), valid)
        g_loss.backward()
        opt_g.step()
        runs["generator"].step(g_loss)

        opt_d.zero_grad()
        real_loss = adversarial(discriminator(real), valid)
        fake_loss = adversarial(discriminator(gen_imgs.detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        d_loss.backward()
        opt_d.step()
        runs["discriminator"].step(d_loss)
        g_losses.append(g_loss.item())
        d_losses.append(d_loss.item())
    for run in runs.values():
        run.close()
    return Outcome(
        runs,
        {
            "start_distance": start,
            "end_distance": distance_to_data(samples()),
            "g_early": mean(g_losses[:30]),
            "g_late": mean(g_losses[-30:]),
            "d_early": mean(d_losses[:30]),
            "d_late": mean(d_losses[-30:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_vanilla_gan_generator_loss_climbs_while_it_learns(gradflow_server, gradflow_env, seed):
    """https://github.com/eriklindernoren/PyTorch-GAN/issues/132"""
    outcome = train_pytorch_gan(gradflow_env, seed)

    # What the thread saw: the discriminator's loss falls and the generator's climbs;
    # yet the samples came much closer to the strokes than where they started.
    facts = outcome.facts
    assert facts["g_late"] > 1.1 * facts["g_early"], facts
    assert facts["d_late"] < facts["d_early"], facts
    assert facts["end_distance"] < 0.7 * facts["start_distance"], facts

    # The correct verdict: nothing is wrong with either network's training.
    assert_silent(gradflow_server, outcome)

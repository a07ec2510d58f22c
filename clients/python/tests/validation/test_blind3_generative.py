"""Generative models (the third set), both healthy: a VAE with a fixed-variance
Gaussian likelihood whose loss goes negative and keeps falling, and a k-diffusion
denoiser whose learning rate follows a per-step inverse schedule that starts at a
hundredth of its value.

The images are 8x8 shapes (a filled rectangle at a random place and size) in [0, 1].
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, assert_silent, mean, watch

pytestmark = pytest.mark.validation

PIXELS = 64


def shapes(size: int, g: torch.Generator) -> torch.Tensor:
    images = torch.zeros(size, 8, 8)
    for i in range(size):
        top, left = torch.randint(0, 5, (2,), generator=g).tolist()
        h, w = torch.randint(2, 5, (2,), generator=g).tolist()
        images[i, top : top + h, left : left + w] = 1.0
    return images.flatten(1)


# -- zhixuan-lin/SPACE#8: the loss of a Gaussian-likelihood VAE is negative ------------


class VAE(nn.Module):
    def __init__(self, latent: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(PIXELS, 128), nn.ELU(), nn.Linear(128, 2 * latent))
        self.decoder = nn.Sequential(
            nn.Linear(latent, 128), nn.ELU(), nn.Linear(128, PIXELS), nn.Sigmoid()
        )


def train_space_like_vae(run_id: str, seed: int, steps: int = 400) -> Outcome:
    """SPACE's objective in small: the pixels' likelihood is a Normal with the model's
    mean and the fixed std 0.15 (SPACE's `fg_sigma`), so -log p(x|z) per pixel is
    0.5 ((x - mu) / 0.15)^2 + log(0.15 sqrt(2 pi)), below 0 once the fit is close;
    the loss is -ELBO, summed over pixels, averaged over the batch. Adam 1e-3 (SPACE's
    1e-4, for its 160k steps)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(11100 + seed)
    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = shapes(256, g)
    with torch.no_grad():
        mse_before = F.mse_loss(model.decoder(model.encoder(probe).chunk(2, 1)[0]), probe).item()
    run = watch(run_id, model, optimizer)
    likelihood = torch.distributions.Normal
    losses = []
    for _ in range(steps):
        x = shapes(32, g)
        mu_z, log_var = model.encoder(x).chunk(2, 1)
        z = mu_z + (0.5 * log_var).exp() * torch.randn(mu_z.shape, generator=g)
        nll = -likelihood(model.decoder(z), 0.15).log_prob(x).sum(1)
        kl = 0.5 * (mu_z**2 + log_var.exp() - 1 - log_var).sum(1)
        loss = (nll + kl).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        run.step(loss)
    run.close()
    with torch.no_grad():
        mse_after = F.mse_loss(model.decoder(model.encoder(probe).chunk(2, 1)[0]), probe).item()
    return Outcome(
        {"model": run},
        {
            "loss_first": mean(losses[:10]),
            "negative_steps": sum(v < 0 for v in losses),
            "loss_last": mean(losses[-10:]),
            "loss_before_last": mean(losses[-80:-60]),
            "mse_before": mse_before,
            "mse_after": mse_after,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_vae_loss_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/zhixuan-lin/SPACE/issues/8"""
    outcome = train_space_like_vae(gradflow_env, seed)

    # The loss crosses 0 and keeps falling below it, while the reconstructions get
    # several times closer to the images.
    facts = outcome.facts
    assert facts["loss_first"] > 0, facts
    assert facts["negative_steps"] > 100, facts
    assert facts["loss_last"] < min(0.0, facts["loss_before_last"]), facts
    assert facts["mse_after"] < 0.3 * facts["mse_before"], facts

    # Healthy: a continuous likelihood's negative log density may be below 0.
    assert_silent(gradflow_server, outcome)


# -- crowsonkb/k-diffusion#50: an inverse lr schedule stepped per batch ----------------


def inverse_lr(inv_gamma: float, power: float, warmup: float):
    """k-diffusion's InverseLR as a multiplier of the base lr at scheduler step n:
    (1 + n / inv_gamma) ** -power, times the exponential warm-up 1 - warmup ** (n + 1)."""
    return lambda n: (1 + n / inv_gamma) ** -power * (1 - warmup ** (n + 1))


class Denoiser(nn.Module):
    """An MLP denoiser over the noised image and the noise level's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(PIXELS + 16, 256),
            nn.GELU(),
            nn.Linear(256, 256),
            nn.GELU(),
            nn.Linear(256, PIXELS),
        )
        self.register_buffer("freqs", torch.randn(8) * 4)

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        angles = c_noise[:, None] * self.freqs[None]
        return self.net(torch.cat([x, angles.sin(), angles.cos()], 1))


def karras_loss(
    model: Denoiser, x: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """k-diffusion's Denoiser.loss with sigma_data 0.5: the preconditioned target."""
    sigma_data = 0.5
    s = sigma[:, None]
    c_skip = sigma_data**2 / (s**2 + sigma_data**2)
    c_out = s * sigma_data / (s**2 + sigma_data**2).sqrt()
    c_in = 1 / (s**2 + sigma_data**2).sqrt()
    noised = x + noise * s
    target = (x - c_skip * noised) / c_out
    return (model(noised * c_in, sigma.log() / 4) - target).pow(2).mean(1).mean()


def train_k_diffusion(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """k-diffusion's train.py: AdamW (lr 2e-3 here for the tiny net, betas (0.95,
    0.999), eps 1e-6, weight decay 1e-3), the inverse schedule (inv_gamma 20000,
    power 1, warmup 0.99) stepped after every optimizer step, sigma drawn log-normal
    (-1.2, 1.2), an EMA copy updated each step with the inverse EMA warm-up (power
    2/3, max 0.9999)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(11200 + seed)
    model = Denoiser()
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=2e-3, betas=(0.95, 0.999), eps=1e-6, weight_decay=1e-3
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_lr(20000.0, 1.0, 0.99))
    probe = shapes(256, g) * 2 - 1
    probe_sigma = torch.full((256,), 0.5)
    probe_noise = torch.randn(probe.shape, generator=g)
    with torch.no_grad():
        probe_before = karras_loss(model, probe, probe_sigma, probe_noise).item()
    run = watch(run_id, model, optimizer)
    lrs = []
    for step in range(steps):
        x = shapes(32, g) * 2 - 1
        sigma = (torch.randn(32, generator=g) * 1.2 - 1.2).exp()
        loss = karras_loss(model, x, sigma, torch.randn(x.shape, generator=g))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        decay = min(1 - (1 + step) ** -0.6667, 0.9999)
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        run.step(loss)
    run.close()
    with torch.no_grad():
        probe_after = karras_loss(model, probe, probe_sigma, probe_noise).item()
    return Outcome(
        {"model": run},
        {
            "lr_first": lrs[0],
            "lr_last": lrs[-1],
            "probe_before": probe_before,
            "probe_after": probe_after,
            "ema_factor_last": math.floor(decay * 1000) / 1000,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_k_diffusion_lr_schedule_stepped_per_batch(gradflow_server, gradflow_env, seed):
    """https://github.com/crowsonkb/k-diffusion/issues/50"""
    outcome = train_k_diffusion(gradflow_env, seed)

    # The lr starts at about 2% of its base and climbs over the run, as the schedule
    # is meant to per step; the denoiser's loss at a fixed noise level falls by half.
    facts = outcome.facts
    assert facts["lr_first"] < 0.03 * 2e-3, facts
    assert facts["lr_last"] > 0.9 * 2e-3, facts
    assert facts["probe_after"] < 0.5 * facts["probe_before"], facts

    # Healthy: a scheduler stepped every batch whose warm-up starts near 0 is the
    # schedule k-diffusion means.
    assert_silent(gradflow_server, outcome)

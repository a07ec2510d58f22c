"""GANs (the third set): a speech-enhancement GAN whose discriminator optimizer lists
one of its two discriminators twice and the other never, a GAN-inversion encoder
whose discriminator's gradients are never zeroed, and pix2pix, which switches its
discriminator's `requires_grad` off and on around every generator update.
"""

from __future__ import annotations

import warnings
from typing import Dict

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, snapshot, watch

pytestmark = pytest.mark.validation

SAMPLES = 64


def moved_names(before: Dict[str, torch.Tensor], module: nn.Module) -> set:
    return {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}


# -- line/open-universe#5: the multi-period discriminator is never optimized -----------


def speech_pair(size: int, g: torch.Generator):
    """A clean "voice" (two sines of random pitch) and the same with noise."""
    t = torch.arange(SAMPLES).float()
    pitch = 0.1 + 0.3 * torch.rand(size, 2, 1, generator=g)
    clean = (torch.sin(pitch[:, :1] * t) + 0.5 * torch.sin(pitch[:, 1:] * t)) / 1.5
    return clean, clean + 0.4 * torch.randn(clean.shape, generator=g)


class Enhancer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2),
            nn.LeakyReLU(0.2),
            nn.Conv1d(16, 16, 5, padding=2),
            nn.LeakyReLU(0.2),
            nn.Conv1d(16, 1, 5, padding=2),
        )

    def forward(self, noisy: torch.Tensor) -> torch.Tensor:
        return noisy + self.net(noisy)


class MultiResolutionDiscriminator(nn.Module):
    """HiFi-GAN-style MRD: a 2-D convolution over each resolution's STFT magnitude."""

    def __init__(self, ffts=(16, 32)) -> None:
        super().__init__()
        self.ffts = ffts
        self.convs = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(1, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(8, 1, 3, padding=1)
            )
            for _ in ffts
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = []
        for n_fft, conv in zip(self.ffts, self.convs):
            spec = torch.stft(
                x.squeeze(1),
                n_fft,
                hop_length=n_fft // 4,
                window=torch.hann_window(n_fft),
                return_complex=True,
            ).abs()
            scores.append(conv(spec.unsqueeze(1)).flatten(1))
        return torch.cat(scores, 1)


class MultiPeriodDiscriminator(nn.Module):
    """HiFi-GAN's MPD: the signal folded by each period, convolved along time."""

    def __init__(self, periods=(2, 3)) -> None:
        super().__init__()
        self.periods = periods
        self.convs = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(1, 8, (5, 1), padding=(2, 0)),
                nn.LeakyReLU(0.2),
                nn.Conv2d(8, 1, (3, 1), padding=(1, 0)),
            )
            for _ in periods
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = []
        for p, conv in zip(self.periods, self.convs):
            pad = (-x.shape[-1]) % p
            folded = F.pad(x, (0, pad), mode="reflect").view(x.shape[0], 1, -1, p)
            scores.append(conv(folded).flatten(1))
        return torch.cat(scores, 1)


class Discriminators(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loss_mrd = MultiResolutionDiscriminator()
        self.loss_mpd = MultiPeriodDiscriminator()


def train_universe_gan(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """UNIVERSE++'s adversarial training in small: least-squares GAN losses from both
    discriminators plus an L1 reconstruction for the enhancer; AdamW 2e-4 betas
    (0.8, 0.99) for each side. The discriminators' optimizer is built from
    `list(self.loss_mrd.parameters()) + list(self.loss_mrd.parameters())`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9100 + seed)
    generator, disc = Enhancer(), Discriminators()
    opt_g = torch.optim.AdamW(generator.parameters(), lr=2e-4, betas=(0.8, 0.99))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns of the duplicated parameters
        params_disc = list(disc.loss_mrd.parameters()) + list(disc.loss_mrd.parameters())
        opt_d = torch.optim.AdamW(params_disc, lr=2e-4, betas=(0.8, 0.99))
    before = snapshot(disc)
    runs = {
        "generator": watch(f"{run_id}-generator", generator, opt_g),
        "discriminator": watch(f"{run_id}-discriminator", disc, opt_d),
    }
    mpd_grads = 0
    for _ in range(steps):
        clean, noisy = speech_pair(16, g)
        enhanced = generator(noisy)
        opt_d.zero_grad()
        d_loss = sum(
            ((d(clean) - 1) ** 2).mean() + (d(enhanced.detach()) ** 2).mean()
            for d in (disc.loss_mrd, disc.loss_mpd)
        )
        d_loss.backward()
        mpd_grads += int(
            all(p.grad is not None and p.grad.abs().sum() > 0 for p in disc.loss_mpd.parameters())
        )
        opt_d.step()
        runs["discriminator"].step(d_loss)
        opt_g.zero_grad()
        g_loss = sum(((d(enhanced) - 1) ** 2).mean() for d in (disc.loss_mrd, disc.loss_mpd))
        g_loss = g_loss + 45 * F.l1_loss(enhanced, clean)
        g_loss.backward()
        opt_g.step()
        runs["generator"].step(g_loss)
    for run in runs.values():
        run.close()
    moved = moved_names(before, disc)
    return Outcome(
        runs,
        {
            "mpd_moved": {n for n in moved if n.startswith("loss_mpd")},
            "mrd_moved": len({n for n in moved if n.startswith("loss_mrd")}),
            "mpd_grad_steps": mpd_grads,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_universe_gan_never_optimizes_the_period_discriminator(gradflow_server, gradflow_env, seed):
    """https://github.com/line/open-universe/issues/5"""
    outcome = train_universe_gan(gradflow_env, seed)

    # The multi-period discriminator gets a gradient on every step and never changes;
    # the multi-resolution one trains.
    facts = outcome.facts
    assert facts["mpd_grad_steps"] == 300, facts
    assert facts["mpd_moved"] == set(), facts
    assert facts["mrd_moved"] == 8, facts

    # The correct verdict: trainable parameters that receive gradients and that no
    # optimizer holds (PROTOCOL: param_not_in_optimizer, cause not_in_optimizer), on
    # the discriminators' run, naming the period discriminator.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="discriminator",
            kind="param_not_in_optimizer",
            causes=("not_in_optimizer",),
            covers=("loss_mpd",),
        ),
    )


# -- Hsintien-Ng/idinvert_pytorch-reproduced#1: optimizer_D.zero_grad() is missing -----


def train_idinvert_encoder(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """In-domain GAN inversion's encoder training: a fixed generator, an encoder E
    trained to reconstruct real images through it (pixel L2 plus an adversarial term),
    and a discriminator D trained on real images against reconstructions (with an R1
    penalty, gamma 10); Adam 1e-4 for each. D's step is missing its `zero_grad()`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9200 + seed)
    latent, pixels = 8, 64
    generator = nn.Sequential(
        nn.Linear(latent, 64), nn.LeakyReLU(0.2), nn.Linear(64, pixels)
    ).requires_grad_(False)
    encoder = nn.Sequential(nn.Linear(pixels, 64), nn.LeakyReLU(0.2), nn.Linear(64, latent))
    discriminator = nn.Sequential(nn.Linear(pixels, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    optimizer_e = torch.optim.Adam(encoder.parameters(), lr=1e-4)
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=1e-4)
    runs = {
        "encoder": watch(f"{run_id}-encoder", encoder, optimizer_e),
        "discriminator": watch(f"{run_id}-discriminator", discriminator, optimizer_d),
    }
    d_grad_norms = []
    for _ in range(steps):
        with torch.no_grad():
            real = generator(torch.randn(16, latent, generator=g))
        # D's update: no optimizer_d.zero_grad() before it.
        real_in = real.clone().requires_grad_(True)
        real_score = discriminator(real_in)
        fake_score = discriminator(generator(encoder(real)).detach())
        r1 = (
            torch.autograd.grad(real_score.sum(), real_in, create_graph=True)[0]
            .pow(2)
            .sum(1)
            .mean()
        )
        d_loss = F.softplus(fake_score).mean() + F.softplus(-real_score).mean() + 5.0 * r1
        d_loss.backward()
        d_grad_norms.append(
            float(torch.cat([p.grad.flatten() for p in discriminator.parameters()]).norm())
        )
        optimizer_d.step()
        runs["discriminator"].step(d_loss)
        # E's update zeroes its own gradients.
        optimizer_e.zero_grad()
        reconstruction = generator(encoder(real))
        e_loss = (
            F.mse_loss(reconstruction, real)
            + 0.1 * F.softplus(-discriminator(reconstruction)).mean()
        )
        e_loss.backward()
        optimizer_e.step()
        runs["encoder"].step(e_loss)
    for run in runs.values():
        run.close()
    return Outcome(runs, {"d_grad_first": d_grad_norms[0], "d_grad_last": d_grad_norms[-1]})


@pytest.mark.parametrize("seed", SEEDS)
def test_idinvert_discriminator_never_zeroed(gradflow_server, gradflow_env, seed):
    """https://github.com/Hsintien-Ng/idinvert_pytorch-reproduced/issues/1"""
    outcome = train_idinvert_encoder(gradflow_env, seed)

    # D's gradient is the running sum of every step's (and of the encoder's adversarial
    # backward through D): by the end it is many times the first step's.
    facts = outcome.facts
    assert facts["d_grad_last"] > 20 * facts["d_grad_first"], facts

    # The correct verdict: the discriminator's gradients carry over from step to step
    # (PROTOCOL: grads_not_zeroed, cause not_zeroed), on the discriminator's run.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="discriminator", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )


# -- junyanz/pytorch-CycleGAN-and-pix2pix#651: D frozen around each G update -----------


def set_requires_grad(net: nn.Module, requires_grad: bool) -> None:
    for p in net.parameters():
        p.requires_grad = requires_grad


def paired_images(size: int, g: torch.Generator):
    """pix2pix's task in small: from a noisy outline (A) to the filled shape (B)."""
    b = torch.zeros(size, 1, 8, 8)
    for i in range(size):
        top, left = torch.randint(0, 4, (2,), generator=g).tolist()
        h, w = torch.randint(3, 5, (2,), generator=g).tolist()
        b[i, 0, top : top + h, left : left + w] = 1.0
    eroded = -F.max_pool2d(-b, 3, stride=1, padding=1)
    a = (b - eroded) + 0.2 * torch.randn(b.shape, generator=g)
    return a * 2 - 1, b * 2 - 1


def train_pix2pix(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """pix2pix's optimize_parameters: forward G; `set_requires_grad(netD, True)`, D's
    update on (A, B) pairs; `set_requires_grad(netD, False)`, G's update on the GAN
    loss plus 100 x L1. Adam 2e-4, betas (0.5, 0.999), vanilla (BCE) GAN loss."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9300 + seed)
    net_g = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 1, 3, padding=1),
        nn.Tanh(),
    )
    net_d = nn.Sequential(
        nn.Conv2d(2, 16, 3, stride=2, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(16, 1, 3, padding=1)
    )
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    probe_a, probe_b = paired_images(128, g)
    with torch.no_grad():
        l1_before = F.l1_loss(net_g(probe_a), probe_b).item()
    runs = {
        "generator": watch(f"{run_id}-generator", net_g, opt_g),
        "discriminator": watch(f"{run_id}-discriminator", net_d, opt_d),
    }
    for _ in range(steps):
        real_a, real_b = paired_images(16, g)
        fake_b = net_g(real_a)
        set_requires_grad(net_d, True)
        opt_d.zero_grad()
        pred_fake = net_d(torch.cat([real_a, fake_b.detach()], 1))
        pred_real = net_d(torch.cat([real_a, real_b], 1))
        loss_d = 0.5 * (
            F.binary_cross_entropy_with_logits(pred_fake, torch.zeros_like(pred_fake))
            + F.binary_cross_entropy_with_logits(pred_real, torch.ones_like(pred_real))
        )
        loss_d.backward()
        opt_d.step()
        runs["discriminator"].step(loss_d)
        set_requires_grad(net_d, False)
        opt_g.zero_grad()
        pred_fake = net_d(torch.cat([real_a, fake_b], 1))
        loss_g = F.binary_cross_entropy_with_logits(
            pred_fake, torch.ones_like(pred_fake)
        ) + 100 * F.l1_loss(fake_b, real_b)
        loss_g.backward()
        opt_g.step()
        runs["generator"].step(loss_g)
    for run in runs.values():
        run.close()
    net_g.eval()
    with torch.no_grad():
        l1_after = F.l1_loss(net_g(probe_a), probe_b).item()
    return Outcome(runs, {"l1_before": l1_before, "l1_after": l1_after})


@pytest.mark.parametrize("seed", SEEDS)
def test_pix2pix_freezes_the_discriminator_around_generator_updates(
    gradflow_server, gradflow_env, seed
):
    """https://github.com/junyanz/pytorch-CycleGAN-and-pix2pix/issues/651"""
    outcome = train_pix2pix(gradflow_env, seed)

    # The generator learned the mapping: its L1 to the targets fell by more than half.
    facts = outcome.facts
    assert facts["l1_after"] < 0.5 * facts["l1_before"], facts

    # Healthy: `requires_grad` off during the generator's update is a speed-up; the
    # discriminator trains on each of its own steps.
    assert_silent(gradflow_server, outcome)

"""An audio case of the sixth set: speech enhancement trained on the negative SI-SDR,
whose loss starts positive and ends far below 0."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from .support import SEEDS, Outcome, assert_silent, mean, watch

pytestmark = pytest.mark.validation


# -- asteroid-team/asteroid#456: the negative SI-SDR goes from 10 to -10 ---------------


def neg_si_sdr(estimate: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """asteroid's `SingleSrcNegSDR("sisdr")`, averaged over the batch."""
    estimate = estimate - estimate.mean(-1, keepdim=True)
    target = target - target.mean(-1, keepdim=True)
    scale = (estimate * target).sum(-1, keepdim=True) / (target.pow(2).sum(-1, keepdim=True) + 1e-8)
    projection = scale * target
    noise = estimate - projection
    ratio = projection.pow(2).sum(-1) / (noise.pow(2).sum(-1) + 1e-8)
    return -(10 * torch.log10(ratio + 1e-8)).mean()


def noisy_speech(size: int, g: torch.Generator, length: int = 256):
    """'Speech': a few harmonics of a random pitch with a random envelope; the mixture
    adds white noise at about 0 dB."""
    t = torch.arange(length).float() / 8000
    f0 = 100 + 200 * torch.rand(size, 1, generator=g)
    clean = sum(
        torch.rand(size, 1, generator=g) * torch.sin(2 * math.pi * k * f0 * t) for k in (1, 2, 3)
    )
    clean = clean * torch.sigmoid(torch.randn(size, 1, generator=g) + 4 * torch.sin(30 * t))
    noise = torch.randn(size, length, generator=g) * clean.std(-1, keepdim=True)
    return (clean + noise).unsqueeze(1), clean


class ConvDenoiser(nn.Module):
    """A small 1-d convolutional mask estimator over a learned filterbank, as DCCRN's
    encoder, mask and decoder in miniature."""

    def __init__(self, filters: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Conv1d(1, filters, 16, stride=8, padding=4)
        self.masker = nn.Sequential(
            nn.Conv1d(filters, 64, 3, padding=1),
            nn.PReLU(),
            nn.Conv1d(64, 64, 3, padding=1),
            nn.PReLU(),
            nn.Conv1d(64, filters, 1),
            nn.Sigmoid(),
        )
        self.decoder = nn.ConvTranspose1d(filters, 1, 16, stride=8, padding=4)

    def forward(self, mixture: torch.Tensor) -> torch.Tensor:
        tf = torch.relu(self.encoder(mixture))
        return self.decoder(tf * self.masker(tf)).squeeze(1)


def train_enhancer(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The thread's setup: a single-source negative SI-SDR, Adam lr 1e-3, gradient
    clipping at 5 as asteroid's recipes."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9800 + seed)
    model = ConvDenoiser()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    held_mix, held_clean = noisy_speech(256, g)
    with torch.no_grad():
        before = neg_si_sdr(model(held_mix), held_clean).item()
        mixture_score = neg_si_sdr(held_mix.squeeze(1), held_clean).item()
    losses = []
    for _ in range(steps):
        mixture, clean = noisy_speech(32, g)
        loss = neg_si_sdr(model(mixture), clean)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    with torch.no_grad():
        after = neg_si_sdr(model(held_mix), held_clean).item()
    return Outcome(
        {"model": run},
        {
            "before": before,
            "after": after,
            "mixture": mixture_score,
            "first": mean(losses[:10]),
            "last": mean(losses[-30:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_enhancer_negative_si_sdr_falls_below_zero(gradflow_server, gradflow_env, seed):
    """https://github.com/asteroid-team/asteroid/issues/456"""
    outcome = train_enhancer(gradflow_env, seed)

    # The loss starts above 0 and ends well below it; the enhanced speech is cleaner
    # than the mixture on held-out samples.
    facts = outcome.facts
    assert facts["first"] > 0 > facts["last"], facts
    assert facts["after"] < facts["mixture"] - 3, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)

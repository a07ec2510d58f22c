"""Sequence models (the second set): an LSTM regressor whose ReLU output layer starts
dead, so no gradient ever flows, and a learnable audio frontend (LEAF) whose Gabor
filters are built under `torch.no_grad()` in `forward`, so they never learn while the
classifier behind them does.
"""

from __future__ import annotations

import math
from typing import List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import (
    SEEDS,
    Diagnosis,
    Outcome,
    assert_caught,
    moved,
    snapshot,
    watch,
)

pytestmark = pytest.mark.validation

STEPS = 300


# -- ProteomicsML#203: an LSTM regressor with a ReLU on its output --------------------

AMINO_ACIDS = 20
MAX_LENGTH = 12


def peptides(count: int, g: torch.Generator) -> torch.Tensor:
    """One-hot peptides of MAX_LENGTH residues."""
    residues = torch.randint(0, AMINO_ACIDS, (count, MAX_LENGTH), generator=g)
    return F.one_hot(residues, AMINO_ACIDS).float()


def collision_cross_section(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A smooth stand-in for a peptide's CCS: a residue-weighted sum plus a length-like
    curvature, standardised as the tutorial standardises its targets (mean 0, sd 1)."""
    raw = (x @ weights).sum(dim=(1, 2)) + 0.1 * (x @ weights).cumsum(1).pow(2).mean(dim=(1, 2))
    return (raw - raw.mean()) / raw.std()


class CCSRegressor(nn.Module):
    """The tutorial's network: an LSTM over the residues, a dense layer with ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(AMINO_ACIDS, 32, batch_first=True)
        self.dense = nn.Linear(32, 1)

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.dense(out[:, -1]).squeeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.pre_activation(x))


def unlucky_regressor(x: torch.Tensor, g: torch.Generator) -> CCSRegressor:
    """The thread's case: an initialisation whose output layer is negative before the
    ReLU on every training peptide. Draws initialisations in turn from `g` until one
    is (about one draw in a few is)."""
    for _ in range(200):
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        model = CCSRegressor()
        with torch.no_grad():
            if model.pre_activation(x).max() < 0:
                return model
    raise AssertionError("no initialisation with a dead output layer in 200 draws")


def train_relu_output(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """The tutorial's training: MSE, Adam at 1e-3, batch 64, standardised targets.
    The ReLU after the last dense layer outputs 0 for every peptide: every gradient is
    exactly zero and the network predicts 0 for good."""
    g = torch.Generator().manual_seed(1000 + seed)
    weights = torch.randn(AMINO_ACIDS, 1, generator=g)
    train_x = peptides(1024, g)
    train_y = collision_cross_section(train_x, weights)
    model = unlucky_regressor(train_x, g)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = snapshot(model)
    run = watch(run_id, model, optimizer)
    grad_norms: List[float] = []
    for _ in range(steps):
        picks = torch.randint(0, len(train_x), (64,), generator=g)
        loss = F.mse_loss(model(train_x[picks]), train_y[picks])
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(
            max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
        )
        optimizer.step()
        run.step(loss)
    run.close()
    with torch.no_grad():
        predictions = model(peptides(256, g))
    return Outcome(
        {"model": run},
        {
            "max_grad": max(grad_norms),
            "moved": moved(before, model),
            "distinct_predictions": predictions.unique().tolist(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_lstm_regressor_with_a_dead_relu_output(gradflow_server, gradflow_env, seed):
    """https://github.com/ProteomicsML/ProteomicsML/pull/203"""
    outcome = train_relu_output(gradflow_env, seed)

    facts = outcome.facts
    # Every gradient is exactly zero on every step, no weight moves, and the network
    # predicts 0 for every peptide, as the thread's validation set showed.
    assert facts["max_grad"] == 0.0, facts
    assert facts["moved"] == set(), facts
    assert facts["distinct_predictions"] == [0.0], facts

    # The correct verdict: backward reaches the whole model and every gradient is 0
    # (PROTOCOL: grad_stuck_zero, cause zero_gradient); the run's own subject.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="grad_stuck_zero", causes=("zero_gradient",)),
    )


# -- leaf-audio-pytorch#3: the Gabor filters are built under no_grad ------------------

SAMPLE_RATE = 2000
CLIP = 400
FREQUENCIES = (150.0, 300.0, 500.0, 700.0)


def tones(count: int, g: torch.Generator) -> tuple:
    labels = torch.randint(0, len(FREQUENCIES), (count,), generator=g)
    t = torch.arange(CLIP) / SAMPLE_RATE
    freq = torch.tensor(FREQUENCIES)[labels].unsqueeze(1)
    phase = 2 * math.pi * torch.rand(count, 1, generator=g)
    waves = torch.sin(2 * math.pi * freq * t + phase) + 0.5 * torch.randn(count, CLIP, generator=g)
    return waves.unsqueeze(1), labels


class GaborConstraint(nn.Module):
    """LEAF's constraint on the filters' centre frequency and bandwidth. The thread's
    line: the clamping runs under `torch.no_grad()`, so its output has no graph back
    to the kernel parameter."""

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size

    def forward(self, kernel: torch.Tensor) -> torch.Tensor:
        mu_lower, mu_upper = 0.0, math.pi
        sigma_lower = 4 * math.sqrt(2 * math.log(2)) / math.pi
        sigma_upper = self.kernel_size * math.sqrt(2 * math.log(2)) / math.pi
        with torch.no_grad():
            mu = kernel[:, 0].clamp(mu_lower, mu_upper)
            sigma = kernel[:, 1].clamp(sigma_lower, sigma_upper)
        return torch.stack([mu, sigma], dim=1)


class GaborConv1D(nn.Module):
    """Complex Gabor filters from a learnable (centre, bandwidth) per filter."""

    def __init__(self, filters: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        mu = torch.linspace(0.2, 2.8, filters)
        sigma = torch.full((filters,), 0.4 * kernel_size)
        self._kernel = nn.Parameter(torch.stack([mu, sigma], dim=1))
        self._constraint = GaborConstraint(kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._constraint(self._kernel)
        t = torch.arange(-(self.kernel_size // 2), self.kernel_size // 2 + 1).float()
        mu, sigma = kernel[:, :1], kernel[:, 1:]
        envelope = torch.exp(-(t**2) / (2 * sigma**2)) / (math.sqrt(2 * math.pi) * sigma)
        real = (envelope * torch.cos(mu * t)).unsqueeze(1)
        imag = (envelope * torch.sin(mu * t)).unsqueeze(1)
        pad = self.kernel_size // 2
        return F.conv1d(x, real, padding=pad) ** 2 + F.conv1d(x, imag, padding=pad) ** 2


class LeafClassifier(nn.Module):
    """LEAF's frontend (Gabor filterbank, squared modulus, pooling, log compression)
    and a small classifier over its 16 channels."""

    def __init__(self) -> None:
        super().__init__()
        self._complex_conv = GaborConv1D(16, 101)
        self.classifier = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, len(FREQUENCIES))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        energy = self._complex_conv(x)
        features = torch.log(F.avg_pool1d(energy, CLIP).squeeze(2) + 1e-5)
        return self.classifier(features)


def train_leaf(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """The thread's toy check, on a task: Adam (lr 2e-3, amsgrad, weight decay 1e-6,
    the thread's settings), cross-entropy on four tones in noise, batch 16. The
    classifier trains; the filterbank's kernel never gets a gradient."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1100 + seed)
    model = LeafClassifier()
    optimizer = torch.optim.Adam(
        model.parameters(), lr=0.002, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-6, amsgrad=True
    )
    kernel_before = model._complex_conv._kernel.detach().clone()
    classifier_before = snapshot(model.classifier)
    run = watch(run_id, model, optimizer)
    kernel_grads = 0
    for _ in range(steps):
        waves, labels = tones(16, g)
        loss = F.cross_entropy(model(waves), labels)
        optimizer.zero_grad()
        loss.backward()
        kernel_grads += model._complex_conv._kernel.grad is not None
        optimizer.step()
        run.step(loss)
    run.close()
    waves, labels = tones(256, g)
    with torch.no_grad():
        acc = (model(waves).argmax(1) == labels).float().mean().item()
    return Outcome(
        {"model": run},
        {
            "kernel_grads": kernel_grads,
            "kernel_moved": not torch.equal(model._complex_conv._kernel, kernel_before),
            "classifier_moved": moved(classifier_before, model.classifier),
            "accuracy": acc,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_leaf_filters_built_under_no_grad(gradflow_server, gradflow_env, seed):
    """https://github.com/denfed/leaf-audio-pytorch/issues/3"""
    outcome = train_leaf(gradflow_env, seed)

    facts = outcome.facts
    # The filterbank never got a gradient and never changed, while the classifier
    # behind it trained (so the loss falls and nothing looks broken).
    assert facts["kernel_grads"] == 0, facts
    assert not facts["kernel_moved"], facts
    assert facts["classifier_moved"], facts
    assert facts["accuracy"] > 0.5, facts

    # The correct verdict: a trainable module backward never reaches, the Gabor
    # filterbank (PROTOCOL: grad_stuck_zero, cause backward_not_reached, or
    # grad_missing); its subject names `_complex_conv`.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="grad_stuck_zero",
            causes=("backward_not_reached", "grad_missing"),
            covers=("_complex_conv",),
        ),
    )

"""Sequence models (the fourth set): a DNA sequence classifier whose plateau scheduler
reads its validation loss in mode `max`, and a wake-word classifier whose gradient
accumulation is undone by a `zero_grad` on every micro-batch.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, watch

pytestmark = pytest.mark.validation


# -- FunctionLab/selene#115: ReduceLROnPlateau in mode 'max' on a loss ----------------

LENGTH = 40
MOTIFS = ("ACGTAC", "TTGACA", "GGGCCC")


def one_hot(sequences: torch.Tensor) -> torch.Tensor:
    return F.one_hot(sequences, 4).permute(0, 2, 1).float()


def dna_batch(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random DNA with each motif planted at a random place with probability 1/2; the
    targets say which motifs a sequence holds (selene's multi-label features)."""
    sequences = torch.randint(0, 4, (size, LENGTH), generator=g)
    targets = (torch.rand(size, len(MOTIFS), generator=g) < 0.5).float()
    for i in range(size):
        for m, motif in enumerate(MOTIFS):
            if targets[i, m]:
                at = int(torch.randint(0, LENGTH - len(motif), (1,), generator=g))
                sequences[i, at : at + len(motif)] = torch.tensor(["ACGT".index(c) for c in motif])
    return one_hot(sequences), targets


class DeepSEA(nn.Module):
    """DeepSEA's shape in small: convolutions with max pooling and dropout, then a
    fully connected layer and one sigmoid output per feature."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(4, 32, 6),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Dropout(0.2),
            nn.Conv1d(32, 32, 4),
            nn.ReLU(),
            nn.AdaptiveMaxPool1d(1),
        )
        self.classifier = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, len(MOTIFS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.conv(x).squeeze(-1))


def train_selene(run_id: str, seed: int, steps: int = 300, every: int = 10) -> Outcome:
    """selene's `TrainModel` as the issue reads it: SGD (lr 0.08, momentum 0.9,
    weight decay 1e-6, DeepSEA's example config), BCE, and
    `ReduceLROnPlateau(optimizer, 'max', patience=16, factor=0.8)` stepped with the
    validation loss at every report (here every 10 steps, patience 2 reports)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4600 + seed)
    model = DeepSEA()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.08, momentum=0.9, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "max", patience=2, factor=0.8)
    run = watch(run_id, model, optimizer)
    validation = dna_batch(256, torch.Generator().manual_seed(4650 + seed))
    losses, cuts = [], 0
    for step in range(steps):
        x, y = dna_batch(32, g)
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        optimizer.step()
        run.step(loss)
        if (step + 1) % every == 0:
            model.eval()
            with torch.no_grad():
                losses.append(
                    F.binary_cross_entropy_with_logits(model(validation[0]), validation[1]).item()
                )
            model.train()
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step(losses[-1])
            cuts += int(optimizer.param_groups[0]["lr"] < lr)
    run.close()
    return Outcome({"model": run}, {"validation": losses, "cuts": cuts})


@pytest.mark.parametrize("seed", SEEDS)
def test_selene_plateau_scheduler_maximises_the_loss(gradflow_server, gradflow_env, seed):
    """https://github.com/FunctionLab/selene/issues/115"""
    outcome = train_selene(gradflow_env, seed)

    # The validation loss fell over the run, and the scheduler, which waits for it to
    # rise above its first reading, cut the lr again and again.
    facts = outcome.facts
    losses = facts["validation"]
    assert losses[-1] < 0.9 * losses[0], facts
    assert facts["cuts"] >= 5, facts

    # The correct verdict: a plateau scheduler whose mode is the wrong way round for
    # its metric (PROTOCOL: plateau_mode_mismatch, subject ReduceLROnPlateau).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="plateau_mode_mismatch",
            causes=("plateau_mode_mismatch",),
            covers=("ReduceLROnPlateau",),
        ),
    )


# -- dscripka/openWakeWord#316: zero_grad on every micro-batch of an accumulation -----

FRAMES, EMBED = 16, 24


def wake_word_batch(size: int, g: torch.Generator, pattern: torch.Tensor):
    """Audio embeddings (16 frames of 24 features): positives hold the wake word's
    pattern at a random frame, negatives do not (one positive in four)."""
    x = torch.randn(size, FRAMES, EMBED, generator=g)
    y = (torch.rand(size, generator=g) < 0.25).float()
    for i in range(size):
        if y[i]:
            at = int(torch.randint(0, FRAMES - len(pattern), (1,), generator=g))
            x[i, at : at + len(pattern)] += 1.5 * pattern
    return x, y


class WakeWordDNN(nn.Module):
    """openWakeWord's `FCNBlock` model: flatten, Linear, LayerNorm, ReLU blocks and a
    sigmoid output."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(FRAMES * EMBED, width),
            nn.LayerNorm(width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.LayerNorm(width),
            nn.ReLU(),
            nn.Linear(width, 1),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def train_open_wake_word(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """openWakeWord's `auto_train` loop as the issue reads it: each batch keeps only
    the hard examples (a negative scored at 0.001 or more, a positive under 0.999),
    `optimizer.zero_grad()` opens every iteration, `loss.backward()` runs on each, and
    `optimizer.step()` only once `accumulated_samples` reaches 128: each step uses the
    last micro-batch's gradient alone. Adam 1e-4 as the repository, batches of 64
    candidates."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4700 + seed)
    pattern = torch.randn(3, EMBED, generator=torch.Generator().manual_seed(4750 + seed))
    model = WakeWordDNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0001)
    run = watch(run_id, model, optimizer)
    accumulated, backwards, window, per_step = 0, 0, [], []
    while run.steps < steps:
        x, y = wake_word_batch(64, g, pattern)
        optimizer.zero_grad()  # on every micro-batch: what came before is lost
        predictions = model(x)
        hard = ((y == 0) & (predictions >= 0.001)) | ((y == 1) & (predictions < 0.999))
        if not hard.any():
            continue
        loss = F.binary_cross_entropy(predictions[hard], y[hard])
        loss.backward()
        backwards += 1
        accumulated += int(hard.sum())
        window.append(loss.detach())
        if accumulated >= 128:
            optimizer.step()
            run.step(torch.stack(window).mean())
            per_step.append(len(window))
            accumulated, window = 0, []
    run.close()
    return Outcome({"model": run}, {"per_step": per_step, "backwards": backwards})


@pytest.mark.parametrize("seed", SEEDS)
def test_open_wake_word_accumulation_zeroed_every_micro_batch(gradflow_server, gradflow_env, seed):
    """https://github.com/dscripka/openWakeWord/issues/316"""
    outcome = train_open_wake_word(gradflow_env, seed)

    # Every optimizer step followed at least two backward passes, and every pass
    # before the last was zeroed away: over half of the gradients were thrown out.
    facts = outcome.facts
    assert min(facts["per_step"]) >= 2, facts["per_step"][:20]
    assert facts["backwards"] >= 2 * len(facts["per_step"]), facts["backwards"]

    # The correct verdict: the gradient was reset between the backward passes of one
    # optimizer step (PROTOCOL: accumulation_reset, cause reset_between_backwards).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="accumulation_reset",
            causes=("reset_between_backwards",),
            covers=("gradients",),
        ),
    )


# -- liyaguang/DCRNN#38: scheduled sampling makes the training loss climb -------------

SENSORS, HORIZON = 4, 12


def traffic_batch(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Daily-cycle readings of 4 sensors, each with a phase of its own, plus a random
    walk (traffic that drifts from its usual level): 12 steps in, the next 12 to
    forecast."""
    start = torch.rand(size, 1, 1, generator=g) * 24
    t = start + torch.arange(2 * HORIZON).float()[None, :, None]
    phase = torch.linspace(0, 1.5, SENSORS)[None, None, :]
    drift = 0.15 * torch.randn(size, 2 * HORIZON, SENSORS, generator=g).cumsum(1)
    series = torch.sin(2 * torch.pi * t / 24 + phase) + drift
    return series[:, :HORIZON], series[:, HORIZON:]


class Seq2SeqForecaster(nn.Module):
    """DCRNN's encoder-decoder in small, with plain GRU cells where DCRNN has its
    diffusion-convolution GRU cells: the encoder reads the 12 inputs, the decoder
    unrolls 12 forecasts, each fed the previous target or its own previous forecast."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.encoder = nn.GRUCell(SENSORS, hidden)
        self.decoder = nn.GRUCell(SENSORS, hidden)
        self.projection = nn.Linear(hidden, SENSORS)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, teacher_p: float, g: torch.Generator
    ) -> torch.Tensor:
        h = torch.zeros(inputs.shape[0], self.encoder.hidden_size)
        for t in range(inputs.shape[1]):
            h = self.encoder(inputs[:, t], h)
        previous = torch.zeros_like(inputs[:, 0])  # the GO symbol
        outputs = []
        for t in range(HORIZON):
            h = self.decoder(previous, h)
            out = self.projection(h)
            outputs.append(out)
            use_truth = float(torch.rand(1, generator=g)) < teacher_p
            previous = targets[:, t] if use_truth else out
        return torch.stack(outputs, 1)


def train_dcrnn(run_id: str, seed: int, steps: int = 300, decay: float = 40.0) -> Outcome:
    """DCRNN's supervisor as the maintainer describes it: scheduled sampling with the
    inverse sigmoid decay `k / (k + exp(step / k))` (`cl_decay_steps`, here 40 for a
    300-step run), MAE loss, Adam (lr 0.01, eps 1e-3), gradient clipping at 5."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5100 + seed)
    model = Seq2SeqForecaster()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    run = watch(run_id, model, optimizer)
    validation = traffic_batch(256, torch.Generator().manual_seed(5150 + seed))

    def free_running_mae() -> float:
        with torch.no_grad():
            forecast = model(validation[0], validation[1], 0.0, g)
        return F.l1_loss(forecast, validation[1]).item()

    start_mae = free_running_mae()
    losses = []
    for step in range(steps):
        teacher_p = decay / (decay + float(torch.exp(torch.tensor(step / decay))))
        inputs, targets = traffic_batch(64, g)
        optimizer.zero_grad()
        loss = F.l1_loss(model(inputs, targets, teacher_p, g), targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    windows = [sum(losses[i : i + 10]) / 10 for i in range(0, steps, 10)]
    low = min(range(len(windows)), key=windows.__getitem__)
    return Outcome(
        {"model": run},
        {
            "start_mae": start_mae,
            "end_mae": free_running_mae(),
            "loss_low": windows[low],
            "loss_after_low": max(windows[low:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_dcrnn_training_loss_climbs_under_scheduled_sampling(gradflow_server, gradflow_env, seed):
    """https://github.com/liyaguang/DCRNN/issues/38"""
    outcome = train_dcrnn(gradflow_env, seed)

    # The training loss went down, then climbed well above its low as the decoder
    # was fed its own forecasts more and more; the free-running forecast (what the
    # validation measures) got far better.
    facts = outcome.facts
    assert facts["loss_after_low"] > 1.3 * facts["loss_low"], facts
    assert facts["end_mae"] < 0.6 * facts["start_mae"], facts

    # The correct verdict: a healthy run whose training task gets harder by design.
    assert_silent(gradflow_server, outcome)

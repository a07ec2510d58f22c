"""Contrastive learning (the fourth set): SupContrast's SimCLR, whose loss looks
saturated after the first epochs while the representation keeps getting better.

The images are the first set's 8x8 class patterns, drawn clean and seen through two
noisy, shifted views; the labels are used only to measure the representation, never
in training.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, assert_silent, mean, watch
from .test_validation_vision import class_patterns, labelled_batch

pytestmark = pytest.mark.validation

CLASSES = 10


class SimCLRNet(nn.Module):
    """SupContrast's `SupConResNet` in small: a convolutional encoder with batch norm
    and an MLP projection head to a normalised 32-d embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.encoder(x)), dim=1)


def augment(images: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A random shift and noise of the probe's strength: the two views of one image
    differ."""
    shift = torch.randint(-1, 2, (2,), generator=g).tolist()
    return torch.roll(images, shifts=shift, dims=(2, 3)) + 0.8 * torch.randn(
        images.shape, generator=g
    )


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SupConLoss without labels (SimCLR): each view's positive is the other view of
    its image, every other view in the batch a negative."""
    z = torch.cat([z1, z2])
    logits = z @ z.T / temperature
    logits.fill_diagonal_(float("-inf"))
    n = z1.shape[0]
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(logits, targets)


def probe_accuracy(model: SimCLRNet, patterns: torch.Tensor, g: torch.Generator) -> float:
    """Nearest class mean on the encoder's features: 256 labelled images give each
    class's mean, 512 others are classified by cosine similarity."""
    model.eval()
    with torch.no_grad():
        images, labels = labelled_batch(patterns, 256, g)
        features = F.normalize(model.encoder(images), dim=1)
        means = torch.stack([features[labels == c].mean(0) for c in range(CLASSES)])
        images, labels = labelled_batch(patterns, 512, g)
        guess = (F.normalize(model.encoder(images), dim=1) @ means.T).argmax(1)
    model.train()
    return (guess == labels).float().mean().item()


def train_simclr(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """SupContrast's `main_supcon.py --method SimCLR` in small: SGD (lr 0.05,
    momentum 0.9, weight decay 1e-4) with a cosine schedule, temperature 0.5,
    batch 64 images in two views."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5700 + seed)
    patterns = class_patterns(CLASSES, 5750 + seed)
    model = SimCLRNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    run = watch(run_id, model, optimizer)
    start_accuracy = probe_accuracy(model, patterns, g)
    losses = []
    for _ in range(steps):
        images = patterns[torch.randint(0, CLASSES, (64,), generator=g)]
        loss = nt_xent(model(augment(images, g)), model(augment(images, g)), 0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "start_accuracy": start_accuracy,
            "end_accuracy": probe_accuracy(model, patterns, g),
            "loss_start": mean(losses[:10]),
            "loss_mid": mean(losses[140:160]),
            "loss_end": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_simclr_loss_saturates_while_the_representation_improves(
    gradflow_server, gradflow_env, seed
):
    """https://github.com/HobbitLong/SupContrast/issues/45"""
    outcome = train_simclr(gradflow_env, seed)

    # The loss barely moves over the second half of the run (a plateau far above 0,
    # the floor a batch's negatives leave), while the features separate the classes
    # better than at the start.
    facts = outcome.facts
    assert facts["loss_end"] > 0.9 * facts["loss_mid"], facts
    assert facts["loss_end"] > 2.0, facts
    assert facts["end_accuracy"] > max(0.5, facts["start_accuracy"] + 0.05), facts

    # The correct verdict: a healthy self-supervised run.
    assert_silent(gradflow_server, outcome)

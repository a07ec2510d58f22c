"""Contrastive and self-supervised learning (the second set): a contrastive graph
clustering network (HSAN) trained without `optimizer.zero_grad()`, and a healthy BYOL
with a momentum (EMA) target whose loss is negative and keeps falling.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import (
    SEEDS,
    Diagnosis,
    Outcome,
    assert_caught,
    assert_silent,
    mean,
    watch,
)
from .test_validation_gan import PROTOTYPES, SIDE

pytestmark = pytest.mark.validation

STEPS = 300


# -- HSAN#6: the optimizer's zero_grad is never called --------------------------------

NODES = 96
COMMUNITIES = 4
FEATURES = 24


def attributed_graph(g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stochastic block model (4 communities) with noisy community features: the
    features smoothed three times by the normalised adjacency (HSAN's Laplacian
    filter), the normalised adjacency itself, and the communities."""
    labels = torch.arange(NODES) % COMMUNITIES
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    edges = torch.rand(NODES, NODES, generator=g) < torch.where(same, 0.2, 0.02)
    adjacency = (edges | edges.T).float()
    adjacency.fill_diagonal_(1.0)
    degree = adjacency.sum(1).rsqrt()
    normalised = degree.unsqueeze(1) * adjacency * degree.unsqueeze(0)
    centres = torch.randn(COMMUNITIES, FEATURES, generator=g)
    x = centres[labels] + 2.0 * torch.randn(NODES, FEATURES, generator=g)
    for _ in range(3):
        x = 0.5 * x + 0.5 * normalised @ x
    return x, normalised, labels


class HSANEncoders(nn.Module):
    """HSAN's two attribute encoders and two structure encoders (MLPs), each view's
    embedding the sum of its attribute and structure embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.ae1 = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 32))
        self.ae2 = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 32))
        self.se1 = nn.Sequential(nn.Linear(NODES, 64), nn.ReLU(), nn.Linear(64, 32))
        self.se2 = nn.Sequential(nn.Linear(NODES, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(
        self, x: torch.Tensor, adjacency: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        z1 = F.normalize(self.ae1(x) + self.se1(adjacency), dim=1)
        z2 = F.normalize(self.ae2(x) + self.se2(adjacency), dim=1)
        return z1, z2


def hard_sample_aware_loss(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    """A cross-view InfoNCE whose negatives are weighted up by their similarity (the
    hard-sample weighting, without its pseudo-labels)."""
    sim = z1 @ z2.T / tau
    weights = (1 + torch.sigmoid(sim.detach())).fill_diagonal_(1.0)
    logits = sim + torch.log(weights)
    targets = torch.arange(len(z1))
    return 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets))


def train_hsan_without_zero_grad(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """HSAN's training loop as the thread found it: full-batch epochs, Adam at 1e-3,
    `loss.backward(); optimizer.step()` with no `zero_grad` anywhere: every step
    uses the sum of all the gradients so far."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1200 + seed)
    x, adjacency, _ = attributed_graph(g)
    model = HSANEncoders()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    growth: List[float] = []
    for _ in range(steps):
        z1, z2 = model(x, adjacency)
        loss = hard_sample_aware_loss(z1, z2)
        loss.backward()
        optimizer.step()
        run.step(loss)
        growth.append(model.ae1[0].weight.grad.norm().item())
    run.close()
    stale = model.ae1[0].weight.grad.detach().clone()
    model.zero_grad()
    hard_sample_aware_loss(*model(x, adjacency)).backward()
    return Outcome(
        {"model": run},
        {
            "stale_norm": stale.norm().item(),
            "fresh_norm": model.ae1[0].weight.grad.norm().item(),
            "first_norm": growth[0],
            "late_norm": mean(growth[-10:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_hsan_never_zeroes_its_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/yueliu1999/HSAN/issues/6"""
    outcome = train_hsan_without_zero_grad(gradflow_env, seed)

    facts = outcome.facts
    # The gradient the optimizer sees is the running sum: it dwarfs one fresh step's.
    assert facts["late_norm"] > 5 * facts["first_norm"], facts
    assert facts["stale_norm"] > 5 * facts["fresh_norm"], facts

    # The correct verdict: gradients carried over from one optimizer step to the next
    # (PROTOCOL: grads_not_zeroed, cause not_zeroed).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )


# -- byol-pytorch#6: a healthy BYOL whose loss is negative ----------------------------


def view(images: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """An augmented view: a random shift of up to one pixel, brightness jitter and
    noise."""
    shift = torch.randint(-1, 2, (2,), generator=g).tolist()
    out = torch.roll(images, shifts=shift, dims=(1, 2))
    scale = 1 + 0.2 * torch.randn(len(images), 1, 1, generator=g)
    return (out * scale + 0.3 * torch.randn(out.shape, generator=g)).flatten(1)


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, outputs)
    )


class BYOL(nn.Module):
    """byol-pytorch's learner: an online encoder with projector and predictor, and a
    target encoder (a deep copy with `requires_grad` off) created in `__init__` by a
    forward pass on a mock batch, so that it is a submodule when the optimizer takes
    `learner.parameters()`."""

    def __init__(self, moving_average_decay: float = 0.99) -> None:
        super().__init__()
        self.online_encoder = nn.Sequential(
            nn.Linear(SIDE * SIDE, 64), nn.ReLU(), nn.Linear(64, 32), mlp(32, 64, 16)
        )
        self.online_predictor = mlp(16, 64, 16)
        self.decay = moving_average_decay
        self.target_encoder = self._make_target()

    def _make_target(self) -> nn.Module:
        import copy

        target = copy.deepcopy(self.online_encoder)
        for p in target.parameters():
            p.requires_grad = False
        return target

    def update_moving_average(self) -> None:
        with torch.no_grad():
            for t, o in zip(self.target_encoder.parameters(), self.online_encoder.parameters()):
                t.mul_(self.decay).add_((1 - self.decay) * o)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.online_encoder[:3](x)

    def forward(self, one: torch.Tensor, two: torch.Tensor) -> torch.Tensor:
        p1 = self.online_predictor(self.online_encoder(one))
        p2 = self.online_predictor(self.online_encoder(two))
        with torch.no_grad():
            t1, t2 = self.target_encoder(one), self.target_encoder(two)
        # The thread's loss function: -2 * cosine similarity (negative, falling to -4).
        loss_one = -2 * F.cosine_similarity(p1, t2.detach(), dim=-1)
        loss_two = -2 * F.cosine_similarity(p2, t1.detach(), dim=-1)
        return (loss_one + loss_two).mean()


def stroke_images(count: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first set's four stroke images, clean, with their kinds."""
    labels = torch.randint(0, len(PROTOTYPES), (count,), generator=g)
    return PROTOTYPES[labels].reshape(count, SIDE, SIDE), labels


def class_separation(learner: BYOL, g: torch.Generator) -> float:
    """Mean cosine between features of the same class minus between different
    classes, on augmented views: 0 for features that ignore the class."""
    images, labels = stroke_images(256, g)
    was = learner.training
    learner.eval()
    with torch.no_grad():
        f = F.normalize(learner.features(view(images, g)), dim=1)
    learner.train(was)
    cos = f @ f.T
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    off = ~torch.eye(len(labels), dtype=torch.bool)
    return (cos[same & off].mean() - cos[~same].mean()).item()


def train_byol(run_id: str, seed: int, steps: int = STEPS) -> Outcome:
    """byol-pytorch's README loop: Adam at 3e-4 over `learner.parameters()` (the
    frozen target included), `loss.backward(); opt.step();
    learner.update_moving_average()`, batch 64, decay 0.99."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1300 + seed)
    learner = BYOL()
    optimizer = torch.optim.Adam(learner.parameters(), lr=3e-4)
    before = class_separation(learner, g)
    run = watch(run_id, learner, optimizer)
    losses = []
    for _ in range(steps):
        images, _ = stroke_images(64, g)
        loss = learner(view(images, g), view(images, g))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.update_moving_average()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "separation_before": before,
            "separation_after": class_separation(learner, g),
            "max_loss_after_20": max(losses[20:]),
            "loss_early": mean(losses[:20]),
            "loss_late": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_byol_loss_negative_and_falling(gradflow_server, gradflow_env, seed):
    """https://github.com/lucidrains/byol-pytorch/issues/6"""
    outcome = train_byol(gradflow_env, seed)

    facts = outcome.facts
    # Alarming: the loss is below 0 on every step past the first few and keeps
    # falling ...
    assert facts["max_loss_after_20"] < 0, facts
    assert facts["loss_late"] < facts["loss_early"] - 0.3, facts
    # ... while the encoder's features came to tell the classes apart.
    assert facts["separation_after"] > facts["separation_before"] + 0.05, facts

    assert_silent(gradflow_server, outcome)

"""Multi-task regression (the third set): FAMO's weighting method clips the shared
parameters' gradients before `loss.backward()`, so the clip finds nothing and every
step uses the unclipped gradient.

The tasks are scene-understanding's three in small: per-pixel classes, depth and
surface normals of 8x8 synthetic scenes, from a shared encoder with one head each.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, watch

pytestmark = pytest.mark.validation

SIDE = 8


def scenes(size: int, g: torch.Generator) -> Tuple[torch.Tensor, ...]:
    """A tilted plane (depth, normal) with a raised square (class 1) on it."""
    slope = torch.randn(size, 2, 1, 1, generator=g) * 0.5
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, SIDE), torch.linspace(-1, 1, SIDE), indexing="ij")
    depth = 3 + slope[:, :1] * xs + slope[:, 1:] * ys
    labels = torch.zeros(size, SIDE, SIDE, dtype=torch.long)
    for i in range(size):
        top, left = torch.randint(0, SIDE - 3, (2,), generator=g).tolist()
        labels[i, top : top + 3, left : left + 3] = 1
    depth = depth - 0.5 * labels.unsqueeze(1)
    normal = F.normalize(
        torch.cat([-slope.expand(-1, -1, SIDE, SIDE), torch.ones(size, 1, SIDE, SIDE)], 1), dim=1
    )
    image = torch.cat([depth, labels.unsqueeze(1).float()], 1) + 0.3 * torch.randn(
        size, 2, SIDE, SIDE, generator=g
    )
    return image, labels, depth, normal


class MultiTaskNet(nn.Module):
    """A shared encoder and three heads, as the repository's SegNet-MTAN in small."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Sequential(
            nn.Conv2d(2, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()
        )
        self.segmentation = nn.Conv2d(32, 2, 1)
        self.depth = nn.Conv2d(32, 1, 1)
        self.normal = nn.Conv2d(32, 3, 1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.shared(x)
        return self.segmentation(features), self.depth(features), self.normal(features)


class FAMO:
    """FAMO's task weighting (its own logits `w`, Adam lr 0.025, weight decay 1e-3):
    the weighted loss is sum(z_i log(l_i - min_i) / c), and `w` follows the change of
    the log losses after each step. `backward` is the repository's: clip the shared
    parameters to `max_norm`, then `loss.backward()`."""

    def __init__(self, tasks: int, max_norm: float) -> None:
        self.w = torch.zeros(tasks, requires_grad=True)
        self.w_opt = torch.optim.Adam([self.w], lr=0.025, weight_decay=1e-3)
        self.min_losses = torch.zeros(tasks)
        self.max_norm = max_norm
        self.prev_loss: torch.Tensor = torch.zeros(tasks)
        self.clip_norms: List[float] = []

    def get_weighted_loss(self, losses: torch.Tensor) -> torch.Tensor:
        self.prev_loss = losses.detach()
        z = F.softmax(self.w, -1).detach()
        d = losses - self.min_losses + 1e-8
        c = (z / d).sum().detach()
        return (d.log() * z / c).sum()

    def update(self, curr_loss: torch.Tensor) -> None:
        delta = (self.prev_loss - self.min_losses + 1e-8).log() - (
            curr_loss - self.min_losses + 1e-8
        ).log()
        with torch.enable_grad():
            d = torch.autograd.grad(F.softmax(self.w, -1), self.w, grad_outputs=delta.detach())[0]
        self.w_opt.zero_grad()
        self.w.grad = d
        self.w_opt.step()

    def backward(self, losses: torch.Tensor, shared_parameters: List[nn.Parameter]) -> torch.Tensor:
        loss = self.get_weighted_loss(losses)
        if self.max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(shared_parameters, self.max_norm)
            self.clip_norms.append(float(norm))
        loss.backward()
        return loss


def task_losses(model: MultiTaskNet, batch: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    image, labels, depth, normal = batch
    seg, dep, nor = model(image)
    return torch.stack(
        [
            F.cross_entropy(seg, labels),
            F.l1_loss(dep, depth),
            (1 - F.cosine_similarity(nor, normal, dim=1)).mean(),
        ]
    )


def train_famo(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The repository's NYUv2 loop: `optimizer.zero_grad()`, `weight_method.backward(
    losses, shared_parameters)`, `optimizer.step()`, then FAMO's update on the new
    losses; Adam (lr 1e-3 here, for the tiny net), max_norm 1.0."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6100 + seed)
    model = MultiTaskNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    famo = FAMO(tasks=3, max_norm=1.0)
    shared = list(model.shared.parameters())
    run = watch(run_id, model, optimizer)
    used_norms: List[float] = []
    first = None
    for _ in range(steps):
        batch = scenes(16, g)
        optimizer.zero_grad()
        losses = task_losses(model, batch)
        first = losses.detach() if first is None else first
        loss = famo.backward(losses, shared)
        used_norms.append(float(torch.cat([p.grad.flatten() for p in shared]).norm()))
        optimizer.step()
        with torch.no_grad():
            famo.update(task_losses(model, batch))
        run.step(loss)
    run.close()
    with torch.no_grad():
        last = task_losses(model, scenes(256, g))
    return Outcome(
        {"model": run},
        {
            "clip_norms": set(famo.clip_norms),
            "unclipped_steps": sum(n > 1.0 for n in used_norms),
            "first_losses": first.tolist(),
            "last_losses": last.tolist(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_famo_clips_before_backward(gradflow_server, gradflow_env, seed):
    """https://github.com/Cranial-XIX/FAMO/issues/4"""
    outcome = train_famo(gradflow_env, seed)

    # The clip ran on every step and found no gradient to cut (the optimizer had just
    # zeroed them); the steps used shared gradients above max_norm.
    facts = outcome.facts
    assert facts["clip_norms"] == {0.0}, facts
    assert facts["unclipped_steps"] > 0, facts
    # The tasks themselves trained.
    assert all(b < a for a, b in zip(facts["first_losses"], facts["last_losses"])), facts

    # The correct verdict: the clip ran where it cannot act on the gradients the
    # optimizer uses, before the backward that writes them (PROTOCOL: clip_after_step,
    # subject `gradients`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="clip_after_step", causes=("clip_after_step",)),
    )

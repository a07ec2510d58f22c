"""Anomaly detection (the fifth set): reverse distillation, whose loop zeroes both
optimizers before every micro-batch's backward while it steps once every two.

The frozen teacher is a fixed random encoder; the projection and the student decoder
each have an optimizer and are watched as two runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, watch

pytestmark = pytest.mark.validation


def textures(size: int, g: torch.Generator) -> torch.Tensor:
    base = torch.sin(torch.linspace(0, 6.28, 16) * 3).view(1, 1, 1, 16)
    return base + 0.3 * torch.randn(size, 1, 16, 16, generator=g)


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (1 - F.cosine_similarity(a.flatten(1), b.flatten(1))).mean()


def train_reverse_distillation(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The repository's train loop: `optimizer_proj` (Adam lr 1e-3, betas 0.5/0.999)
    over the projection, `optimizer_distill` (Adam lr 5e-3, betas 0.5/0.999) over the
    student decoder, and for every micro-batch `optimizer_proj.zero_grad()`,
    `optimizer_distill.zero_grad()`, `loss.backward()`, then both steps when
    `(i + 1) % accumulation_steps == 0` (2); batch 8."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6900 + seed)
    teacher = nn.ModuleList(
        [nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.Conv2d(8, 16, 3, stride=2, padding=1)]
    )
    teacher.requires_grad_(False).eval()
    projection = nn.Sequential(nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16), nn.ReLU())
    decoder = nn.ModuleDict(
        {
            "deconv": nn.ConvTranspose2d(16, 8, 2, stride=2),
            "conv2": nn.Conv2d(16, 16, 3, padding=1),
            "conv1": nn.Conv2d(8, 8, 3, padding=1),
        }
    )
    optimizer_proj = torch.optim.Adam(projection.parameters(), lr=1e-3, betas=(0.5, 0.999))
    optimizer_distill = torch.optim.Adam(decoder.parameters(), lr=5e-3, betas=(0.5, 0.999))
    runs = {
        "projection": watch(f"{run_id}-proj", projection, optimizer_proj),
        "decoder": watch(f"{run_id}-decoder", decoder, optimizer_distill),
    }

    def micro_loss(images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            f1 = F.relu(teacher[0](images))
            f2 = F.relu(teacher[1](f1))
        bottleneck = projection(f2)
        r2 = decoder["conv2"](bottleneck)
        r1 = decoder["conv1"](F.relu(decoder["deconv"](bottleneck)))
        return cosine_distance(f1, r1) + cosine_distance(f2, r2)

    accumulation_steps = 2
    used = accumulated = None
    micro = []
    for i in range(steps * accumulation_steps):
        images = textures(8, g)
        micro.append(images)
        loss = micro_loss(images)
        optimizer_proj.zero_grad()
        optimizer_distill.zero_grad()
        loss.backward()
        if (i + 1) % accumulation_steps == 0:
            if i + 1 == 200:
                # What the step uses, against what the two micro-batches add up to.
                used = decoder["conv2"].weight.grad.clone()
                params = list(decoder["conv2"].parameters())
                accumulated = sum(
                    torch.autograd.grad(micro_loss(m), params[0])[0] for m in micro[-2:]
                )
            optimizer_proj.step()
            optimizer_distill.step()
            for run in runs.values():
                run.step(loss)
    for run in runs.values():
        run.close()
    return Outcome(
        runs,
        {
            "used_vs_accumulated": (used - accumulated).norm().item() / accumulated.norm().item(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_reverse_distillation_zeroes_every_micro_batch(gradflow_server, gradflow_env, seed):
    """https://github.com/tientrandinh/Revisiting-Reverse-Distillation/issues/12"""
    outcome = train_reverse_distillation(gradflow_env, seed)

    # The step used one micro-batch's gradient, far from the two micro-batches' sum
    # that accumulation means.
    assert outcome.facts["used_vs_accumulated"] > 0.2, outcome.facts

    # The correct verdict (PROTOCOL: accumulation_reset on `gradients`, cause
    # reset_between_backwards), on the decoder's run (the projection's has the same loop).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="decoder", kind="accumulation_reset", causes=("reset_between_backwards",)),
    )

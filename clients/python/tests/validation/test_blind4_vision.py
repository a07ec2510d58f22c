"""Vision (the fourth set): two healthy runs that look wrong. A Mean Teacher whose
teacher seems never to move and whose loss climbs while the consistency weight ramps
up, and a segmentation network whose encoder is frozen for its warm-up epochs and
then unfrozen.

The images are the first set's 8x8 class patterns and the third set's squares.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, assert_silent, mean, watch
from .test_blind3_vision import segmentation_batch
from .test_validation_vision import accuracy, class_patterns, labelled_batch

pytestmark = pytest.mark.validation

CLASSES = 4


# -- CuriousAI/mean-teacher#28: the teacher moves by EMA, the loss climbs -------------


class ConvNet(nn.Module):
    """Mean Teacher's convnet in small: convolutions with batch norm and leaky ReLU,
    dropout, a global pool and a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.LeakyReLU(0.1),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.LeakyReLU(0.1),
            nn.MaxPool2d(2),
            nn.Dropout(0.5),
        )
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


def sigmoid_rampup(step: int, length: int) -> float:
    """Mean Teacher's `ramps.sigmoid_rampup`: exp(-5 (1 - t)^2)."""
    t = min(max(step, 0), length) / length
    return float(torch.exp(torch.tensor(-5.0 * (1.0 - t) ** 2)))


def train_mean_teacher(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The repository's `pytorch/main.py` in small: a student and an EMA teacher of
    the same net (the teacher's parameters detached), 8 labelled images and 24
    unlabelled in each batch with noise of their own for each network, class loss on
    the labelled ones, a softmax-MSE consistency between student and teacher weighted
    by `consistency * sigmoid_rampup` (consistency 10, ramp over 200 steps), SGD
    Nesterov (lr 0.05, momentum 0.9, weight decay 2e-4) and
    `update_ema_variables(model, ema_model, alpha=0.99, global_step)`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4800 + seed)
    patterns = class_patterns(CLASSES, 4850 + seed)
    student, teacher = ConvNet(), ConvNet()
    for param in teacher.parameters():
        param.detach_()
    teacher.load_state_dict(student.state_dict())
    optimizer = torch.optim.SGD(
        student.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=2e-4
    )
    run = watch(run_id, student, optimizer)
    teacher_start = teacher.fc.weight.detach().clone()
    start_accuracy = accuracy(teacher, patterns, g)
    losses, teacher_moves = [], []
    for step in range(steps):
        images, labels = labelled_batch(patterns, 32, g)
        labels[8:] = -1  # NO_LABEL
        student_in = images + 0.3 * torch.randn(images.shape, generator=g)
        teacher_in = images + 0.3 * torch.randn(images.shape, generator=g)
        logits = student(student_in)
        with torch.no_grad():
            teacher_logits = teacher(teacher_in)
        class_loss = F.cross_entropy(logits, labels, ignore_index=-1)
        weight = 10.0 * sigmoid_rampup(step, 200)
        consistency = F.mse_loss(F.softmax(logits, 1), F.softmax(teacher_logits, 1)) * CLASSES
        loss = class_loss + weight * consistency
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        before = teacher.fc.weight.detach().clone()
        alpha = min(1 - 1 / (step + 1), 0.99)
        with torch.no_grad():
            for ema_param, param in zip(teacher.parameters(), student.parameters()):
                ema_param.mul_(alpha).add_(param, alpha=1 - alpha)
        teacher_moves.append((teacher.fc.weight - before).norm().item())
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"student": run},
        {
            "start_accuracy": start_accuracy,
            "teacher_accuracy": accuracy(teacher, patterns, g),
            "teacher_moved": not torch.equal(teacher.fc.weight, teacher_start),
            "late_teacher_move": mean(teacher_moves[-20:]),
            "loss_low": min(mean(losses[i : i + 20]) for i in range(0, 100, 20)),
            "loss_late": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_mean_teacher_loss_climbs_as_consistency_ramps(gradflow_server, gradflow_env, seed):
    """https://github.com/CuriousAI/mean-teacher/issues/28"""
    outcome = train_mean_teacher(gradflow_env, seed)

    # The teacher moves by a little at each step (what the thread took for no move at
    # all) and ends far better than it began; the loss ends above its early low as
    # the consistency term's weight ramps up.
    facts = outcome.facts
    assert facts["teacher_moved"] and facts["late_teacher_move"] > 0, facts
    assert facts["teacher_accuracy"] > facts["start_accuracy"] + 0.3, facts
    assert facts["loss_late"] > facts["loss_low"], facts

    # The correct verdict: a healthy semi-supervised run.
    assert_silent(gradflow_server, outcome)


# -- mapbox/robosat#72: the encoder frozen for the warm-up epochs, then unfrozen ------


class EncoderDecoder(nn.Module):
    """robosat's U-Net shape in small: an encoder of two convolution stages (the
    pre-trained ResNet's place), a decoder that upsamples back and a 1x1 score."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose2d(32, 16, 2, stride=2), nn.ReLU())
        self.final = nn.Conv2d(32, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        return self.final(torch.cat([self.dec(e2), e1], dim=1))

    def encoder(self) -> list:
        return [self.enc1, self.enc2]


def pixel_accuracy(model: nn.Module, g: torch.Generator) -> float:
    images, labels = segmentation_batch(256, g)
    model.eval()
    with torch.no_grad():
        right = (model(images).argmax(1) == labels).float().mean().item()
    model.train()
    return right


def train_robosat_warmup(run_id: str, seed: int, epochs: int = 4, per_epoch: int = 80) -> Outcome:
    """The issue's plan in robosat's loop: Adam (lr 1e-3) over `net.parameters()`,
    cross-entropy per pixel, and `freeze()` (the encoder's `requires_grad = False`)
    for the first warm-up epoch, then the encoder unfrozen for the rest."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4900 + seed)
    model = EncoderDecoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    run = watch(run_id, model, optimizer)
    start_accuracy = pixel_accuracy(model, g)
    encoder_weight = model.enc1[0].weight
    at_start = encoder_weight.detach().clone()
    frozen_moved = False
    for epoch in range(epochs):
        warmup = epoch == 0
        for stage in model.encoder():
            for param in stage.parameters():
                param.requires_grad = not warmup
        for _ in range(per_epoch):
            images, labels = segmentation_batch(16, g)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            run.step(loss)
        if warmup:
            frozen_moved = not torch.equal(encoder_weight.detach(), at_start)
    run.close()
    return Outcome(
        {"model": run},
        {
            "frozen_moved": frozen_moved,
            "encoder_moved": not torch.equal(encoder_weight.detach(), at_start),
            "start_accuracy": start_accuracy,
            "end_accuracy": pixel_accuracy(model, g),
            "steps": run.steps,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_robosat_encoder_frozen_for_the_warmup(gradflow_server, gradflow_env, seed):
    """https://github.com/mapbox/robosat/issues/72"""
    outcome = train_robosat_warmup(gradflow_env, seed)

    # The encoder stayed put through the 80 warm-up steps and trained afterwards;
    # the network learned to segment the squares.
    facts = outcome.facts
    assert facts["steps"] == 320, facts
    assert not facts["frozen_moved"] and facts["encoder_moved"], facts
    assert facts["end_accuracy"] > 0.9 and facts["end_accuracy"] > facts["start_accuracy"], facts

    # The correct verdict: freezing on purpose for a warm-up is no failure.
    assert_silent(gradflow_server, outcome)

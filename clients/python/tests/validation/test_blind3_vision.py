"""Vision (the third set): a segmentation trainer whose mid-epoch validation leaves
the network in eval mode, a detector whose warm-up scheduler multiplies an already
scaled learning rate at every step, and the PyTorch quickstart's classifier, which
trains in eval mode after its first test without any harm (it has neither dropout
nor batch norm).

The images are the first set's 8x8 random patterns, drawn with noise and a shift.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, watch
from .test_validation_vision import accuracy, class_patterns, labelled_batch

pytestmark = pytest.mark.validation

SIDE = 8


# -- wkentaro/pytorch-fcn#56: validation mid-epoch leaves the model in eval mode ------


def segmentation_batch(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """A bright square of class 1 or a dark square of class 2 on a background of
    class 0, with noise: 8x8 images and their per-pixel labels."""
    images = torch.zeros(size, 1, SIDE, SIDE)
    labels = torch.zeros(size, SIDE, SIDE, dtype=torch.long)
    for i in range(size):
        cls = int(torch.randint(1, 3, (1,), generator=g))
        top, left = torch.randint(0, SIDE - 3, (2,), generator=g).tolist()
        images[i, 0, top : top + 4, left : left + 4] = 1.0 if cls == 1 else -1.0
        labels[i, top : top + 4, left : left + 4] = cls
    return images + 0.5 * torch.randn(images.shape, generator=g), labels


class TinyFCN(nn.Module):
    """FCN's shape in small: convolutions, a pooled stage, the dropout FCN puts after
    its fully convolutional layers (drop6, drop7), a 1x1 score layer and a learned
    upsampling back to the input's size."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc6 = nn.Conv2d(32, 32, 1)
        self.drop6 = nn.Dropout2d(0.5)
        self.score = nn.Conv2d(32, classes, 1)
        self.upscore = nn.ConvTranspose2d(classes, classes, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop6(F.relu(self.fc6(x)))
        return self.upscore(self.score(x))


def train_fcn_trainer(run_id: str, seed: int, epochs: int = 4) -> Outcome:
    """The repository's Trainer: `train_epoch` calls `model.train()` once at its start,
    and `validate()` (which calls `model.eval()`) runs whenever the global iteration is
    a multiple of `interval_validate`, from inside the epoch's loop. With an epoch of
    100 iterations and a validation every 70, the rest of each epoch after a validation
    trains in eval mode. SGD with momentum as in the repository, its lr scaled to the
    tiny net and a mean loss (0.05, momentum 0.9)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4100 + seed)
    model = TinyFCN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = watch(run_id, model, optimizer)
    iteration, interval_validate, per_epoch = 0, 70, 100
    eval_steps = 0
    for _ in range(epochs):
        model.train()
        for _ in range(per_epoch):
            if iteration % interval_validate == 0:
                model.eval()  # validate(): what the thread says is never undone
                with torch.no_grad():
                    images, labels = segmentation_batch(32, g)
                    F.cross_entropy(model(images), labels)
            images, labels = segmentation_batch(16, g)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            eval_steps += int(not model.training)
            run.step(loss)
            iteration += 1
    run.close()
    return Outcome({"model": run}, {"eval_steps": eval_steps, "steps": iteration})


@pytest.mark.parametrize("seed", SEEDS)
def test_fcn_trains_on_in_eval_mode_after_validation(gradflow_server, gradflow_env, seed):
    """https://github.com/wkentaro/pytorch-fcn/pull/56"""
    outcome = train_fcn_trainer(gradflow_env, seed)

    # Three of the four hundred steps ran with dropout off: the first epoch entirely
    # (the iteration-0 validation), then the end of every later epoch.
    facts = outcome.facts
    assert facts["steps"] == 400, facts
    assert facts["eval_steps"] == 100 + 60 + 90 + 50, facts

    # The correct verdict: the model, which has dropout, was seen training in train
    # mode and then stayed in eval mode for dozens of steps (PROTOCOL:
    # model_in_eval_mode, cause left_in_eval).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="model_in_eval_mode", causes=("left_in_eval",)),
    )


# -- potterhsu/easy-faster-rcnn.pytorch#26: a chained warm-up multiplies the lr away ---


class WarmUpMultiStepLR(torch.optim.lr_scheduler.MultiStepLR):
    """The repository's scheduler: a linear warm-up factor from 1/3 to 1 over 500
    iterations, applied to `MultiStepLR.get_lr()`. Since PyTorch 1.4 that method is
    chainable (it returns the group's current lr, not the base lr), so each step
    multiplies the lr the previous step already scaled."""

    def __init__(self, optimizer, milestones, gamma=0.1, factor=0.3333, num_iters=500):
        self.factor = factor
        self.num_iters = num_iters
        super().__init__(optimizer, milestones, gamma)

    def get_lr(self) -> List[float]:  # type: ignore[override]
        if self.last_epoch < self.num_iters:
            alpha = self.last_epoch / self.num_iters
            scale = (1 - self.factor) * alpha + self.factor
        else:
            scale = 1.0
        return [lr * scale for lr in super().get_lr()]


class TinyDetector(nn.Module):
    """A backbone and the two heads of a detector: class scores and box offsets."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()
        )
        self.cls_head = nn.Linear(16 * 4 * 4, classes)
        self.box_head = nn.Linear(16 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(x)
        return self.cls_head(features), self.box_head(features)


def train_faster_rcnn_warmup(run_id: str, seed: int, steps: int = 400) -> Outcome:
    """The repository's train.py: SGD lr 1e-3, momentum 0.9, weight decay 5e-4,
    milestones at 50000 and 70000, `scheduler.step()` after every `optimizer.step()`.
    The loss is the classifier's cross entropy plus a smooth L1 on the box (here: the
    pattern's shift)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4200 + seed)
    patterns = class_patterns(4, seed)
    model = TinyDetector(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    scheduler = WarmUpMultiStepLR(optimizer, milestones=[50000, 70000])
    run = watch(run_id, model, optimizer)
    lrs: List[float] = []
    for _ in range(steps):
        labels = torch.randint(0, 4, (32,), generator=g)
        shift = torch.randint(-1, 2, (32, 2), generator=g)
        images = torch.stack(
            [torch.roll(patterns[c], shifts=s.tolist(), dims=(1, 2)) for c, s in zip(labels, shift)]
        )
        images = images + 0.8 * torch.randn(images.shape, generator=g)
        optimizer.zero_grad()
        scores, boxes = model(images)
        loss = F.cross_entropy(scores, labels) + F.smooth_l1_loss(boxes, shift.float())
        loss.backward()
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"lr_at_20": lrs[19], "lr_last": lrs[-1], "lr_max": max(lrs)})


@pytest.mark.parametrize("seed", SEEDS)
def test_faster_rcnn_warmup_multiplies_the_lr_away(gradflow_server, gradflow_env, seed):
    """https://github.com/potterhsu/easy-faster-rcnn.pytorch/issues/26"""
    outcome = train_faster_rcnn_warmup(gradflow_env, seed)

    # The warm-up meant to climb from lr/3 to lr leaves it below 1e-12 within twenty
    # steps and near nothing for the rest of the run.
    facts = outcome.facts
    assert facts["lr_at_20"] < 1e-12, facts
    assert facts["lr_last"] < 1e-50, facts

    # The correct verdict: the lr fell by far more than 10^8 of its highest and stayed
    # there, decaying rather than being set to 0 (PROTOCOL: lr_vanished, cause
    # lr_decayed; subject `run`, the optimizer's only group).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_decayed",)),
    )


# -- pytorch/tutorials#1624: the quickstart trains in eval mode, harmlessly -------------


class QuickstartNetwork(nn.Module):
    """The quickstart's NeuralNetwork: flatten, 512, ReLU, 512, ReLU, logits; no
    dropout, no batch norm."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(SIDE * SIDE, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(self.flatten(x))


def train_quickstart(run_id: str, seed: int, epochs: int = 5, per_epoch: int = 80) -> Outcome:
    """The tutorial's loop as the thread read it: `train()` never calls
    `model.train()`, `test()` calls `model.eval()`, so from the second epoch on the
    model trains in eval mode. SGD, batch 64, cross entropy (lr 0.05 here: the
    tutorial's 1e-3 with its 4,690 steps, shortened to 400)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4300 + seed)
    patterns = class_patterns(10, seed)
    model = QuickstartNetwork(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = accuracy(model, patterns, g)
    run = watch(run_id, model, optimizer)
    eval_steps = 0
    for _ in range(epochs):
        for _ in range(per_epoch):
            images, labels = labelled_batch(patterns, 64, g)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            eval_steps += int(not model.training)
            run.step(loss)
        model.eval()  # test()
        with torch.no_grad():
            images, labels = labelled_batch(patterns, 256, g)
            F.cross_entropy(model(images), labels)
    run.close()
    return Outcome(
        {"model": run},
        {"eval_steps": eval_steps, "before": before, "after": accuracy(model, patterns, g)},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_quickstart_trains_in_eval_mode_without_harm(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/tutorials/issues/1624"""
    outcome = train_quickstart(gradflow_env, seed)

    # Four epochs of five ran in eval mode, and the classifier learned: eval mode
    # changes nothing in a network without dropout or batch norm.
    facts = outcome.facts
    assert facts["eval_steps"] == 320, facts
    assert facts["before"] < 0.3, facts
    assert facts["after"] > 0.8, facts

    # Healthy: nothing in this model depends on the training flag (at most an info).
    assert_silent(gradflow_server, outcome)

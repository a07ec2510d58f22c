"""Vision cases of the sixth set: the transfer-learning tutorial's StepLR stepped on
every batch, BiFPN fusion weights filtered out of a detector's optimizer groups, the
prompts of an earlier task decayed by SGD while frozen, a detector's warm-up stepped
per iteration beside a per-epoch schedule, and a pileup-image classifier whose loss
stays high on noisy labels while it keeps improving (bf16 autocast on the CPU).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, snapshot, watch

pytestmark = pytest.mark.validation


def blobs(size: int, g: torch.Generator, templates: torch.Tensor, noise: float = 1.0):
    """Images of `len(templates)` classes: a class template plus noise."""
    labels = torch.randint(0, templates.shape[0], (size,), generator=g)
    x = templates[labels] + noise * torch.randn(size, *templates.shape[1:], generator=g)
    return x, labels


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 2, channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


# -- pytorch/tutorials#640: the tutorial's StepLR stepped on every batch ---------------


def train_tutorial_steplr(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The transfer-learning tutorial's setup: SGD lr 1e-3, momentum 0.9,
    `StepLR(step_size=7, gamma=0.1)`, meant to step once an epoch, called after every
    batch (the lr is divided by 10 every 7 batches)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8100 + seed)
    templates = torch.randn(2, 3, 16, 16, generator=g) * 0.5
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.1)
    run = watch(run_id, model, optimizer)
    held_x, held_y = blobs(512, g, templates)
    mid = None
    for step in range(steps):
        x, y = blobs(16, g, templates)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        run.step(loss)
        if step == 99:
            mid = snapshot(model)
    run.close()
    frozen = all(torch.equal(p.detach(), mid[n]) for n, p in model.named_parameters())
    return Outcome(
        {"model": run},
        {
            "last_lr": optimizer.param_groups[0]["lr"],
            "unchanged_after_100": frozen,
            "accuracy": accuracy(model, held_x, held_y),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_tutorial_steplr_stepped_every_batch(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/tutorials/pull/640"""
    outcome = train_tutorial_steplr(gradflow_env, seed)

    # The lr is below 1e-40 at the end; no weight changed over the last 200 steps.
    facts = outcome.facts
    assert facts["last_lr"] < 1e-40, facts
    assert facts["unchanged_after_100"], facts

    # The correct verdict: the per-epoch schedule decayed the lr away, per batch.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_decayed",), covers=("run",)),
    )


# -- bubbliiiing/efficientdet-pytorch#37: BiFPN weights outside the optimizer groups ---


class BiFPNLayer(nn.Module):
    """Fast normalised fusion: two learned non-negative weights mix the two inputs."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.ones(2))
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        w = F.relu(self.w1)
        w = w / (w.sum() + 1e-4)
        return F.silu(self.bn(self.conv(w[0] * a + w[1] * b)))


class TinyDetector(nn.Module):
    """A backbone with two levels, a BiFPN fusion, a class head and a box head on a
    4x4 grid."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.SiLU()
        )
        self.down = nn.Sequential(
            nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.SiLU()
        )
        self.bifpn = BiFPNLayer()
        self.cls_head = nn.Conv2d(16, 1, 1)
        self.box_head = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor):
        p3 = self.stem(x)
        p4 = self.down(p3)
        fused = self.bifpn(F.avg_pool2d(p3, 2), p4)
        return self.cls_head(fused).flatten(1), self.box_head(fused)


def yolo_param_groups(model: nn.Module):
    """Optimizer groups built by walking the modules, the filtering the thread found in
    the user's training code (YOLO-style): batch-norm weights (no decay), other
    modules' `.weight` (decay) and `.bias`; a Parameter held under any other attribute
    is in none of them."""
    pg0, pg1, pg2 = [], [], []
    for module in model.modules():
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            pg2.append(module.bias)
        if isinstance(module, nn.BatchNorm2d):
            pg0.append(module.weight)
        elif isinstance(getattr(module, "weight", None), nn.Parameter):
            pg1.append(module.weight)
    return pg0, pg1, pg2


def detection_batch(size: int, g: torch.Generator):
    """One bright square per image: the grid cell holding its centre is positive, with
    the square's offset and size as the box target."""
    x = 0.3 * torch.randn(size, 3, 16, 16, generator=g)
    cells = torch.randint(0, 16, (size,), generator=g)
    obj = torch.zeros(size, 16)
    obj[torch.arange(size), cells] = 1.0
    boxes = torch.rand(size, 4, generator=g)
    for i in range(size):
        r, c = divmod(int(cells[i]), 4)
        x[i, :, r * 4 : r * 4 + 4, c * 4 : c * 4 + 4] += 1.0 + boxes[i, :3].view(3, 1, 1)
    return x, obj, cells, boxes


def detection_loss(model: TinyDetector, g: torch.Generator, size: int = 16) -> torch.Tensor:
    """BCE on the grid and an L1 box loss on the positive cell, on a fresh batch."""
    x, obj, cells, boxes = detection_batch(size, g)
    logits, box = model(x)
    box = box.flatten(2)[torch.arange(size), :, cells]
    return F.binary_cross_entropy_with_logits(logits, obj) + F.l1_loss(box, boxes)


def train_efficientdet(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The grouped optimizer (Adam lr 1e-3 over pg0, pg1 with weight decay 5e-4 and pg2;
    this case's numbers); focal-style BCE on the grid and an L1 box loss on the positive
    cell."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8200 + seed)
    model = TinyDetector()
    pg0, pg1, pg2 = yolo_param_groups(model)
    optimizer = torch.optim.Adam(pg0, lr=1e-3)
    optimizer.add_param_group({"params": pg1, "weight_decay": 5e-4})
    optimizer.add_param_group({"params": pg2})
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    w_grads = []
    losses = []
    for _ in range(steps):
        loss = detection_loss(model, g)
        optimizer.zero_grad()
        loss.backward()
        w_grads.append(model.bifpn.w1.grad.abs().sum().item())
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    now = dict(model.named_parameters())
    return Outcome(
        {"model": run},
        {
            "w_unchanged": torch.equal(now["bifpn.w1"].detach(), before["bifpn.w1"]),
            "w_grad_share": mean([float(v > 0) for v in w_grads]),
            "conv_moved": not torch.equal(
                now["bifpn.conv.weight"].detach(), before["bifpn.conv.weight"]
            ),
            "first": mean(losses[:20]),
            "last": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_efficientdet_bifpn_weights_outside_the_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/bubbliiiing/efficientdet-pytorch/issues/37"""
    outcome = train_efficientdet(gradflow_env, seed)

    # The fusion weights get a gradient on every step and stay at [1, 1]; the rest of
    # the detector trains.
    facts = outcome.facts
    assert facts["w_unchanged"] and facts["w_grad_share"] == 1.0, facts
    assert facts["conv_moved"] and facts["last"] < 0.8 * facts["first"], facts

    # The correct verdict: trainable parameters outside the optimizer, in the BiFPN.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="param_not_in_optimizer",
            causes=("not_in_optimizer",),
            covers=("bifpn",),
        ),
    )


# -- iamwangyabin/S-Prompts#2: the earlier task's prompts decayed while frozen ----------


class PromptLearner(nn.Module):
    """A frozen feature extractor, one learned prompt per task added to its features,
    and a classifier per task."""

    def __init__(self, tasks: int = 2, dim: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(24, dim), nn.ReLU())
        self.backbone.requires_grad_(False)
        self.prompt_pool = nn.ModuleList(nn.Embedding(1, dim) for _ in range(tasks))
        self.classifier_pool = nn.ModuleList(nn.Linear(dim, classes) for _ in range(tasks))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        h = self.backbone(x) + self.prompt_pool[task].weight
        return self.classifier_pool[task](F.relu(h))


def train_s_prompts(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Two tasks in sequence (100 steps, then 200): before the second, the first task's
    prompt and classifier are set `requires_grad = False`; the optimizer is SGD with
    momentum and weight decay (0.05, 0.9, 5e-4 here) over all of
    `self._network.parameters()`,
    and `zero_grad` leaves zero tensors in `.grad` (PyTorch before 2.0)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8300 + seed)
    centres = torch.randn(2, 4, 24, generator=g)
    model = PromptLearner()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    run = watch(run_id, model, optimizer)
    frozen_at = None
    losses = []
    for step in range(steps):
        task = 0 if step < 100 else 1
        if step == 100:
            for module in (model.prompt_pool[0], model.classifier_pool[0]):
                module.requires_grad_(False)
            frozen_at = snapshot(model.prompt_pool[0])
        y = torch.randint(0, 4, (32,), generator=g)
        x = centres[task, y] + 0.5 * torch.randn(32, 24, generator=g)
        loss = F.cross_entropy(model(x, task), y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    old = frozen_at["weight"]
    new = model.prompt_pool[0].weight.detach()
    return Outcome(
        {"model": run},
        {
            "prompt_shrink": (new.norm() / old.norm()).item(),
            "prompt_moved": not torch.equal(new, old),
            "task2_first": mean(losses[100:120]),
            "task2_last": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_s_prompts_frozen_prompts_decayed_by_the_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/iamwangyabin/S-Prompts/pull/2"""
    outcome = train_s_prompts(gradflow_env, seed)

    # The first task's prompt, frozen, keeps shrinking under weight decay while the
    # second task trains.
    facts = outcome.facts
    assert facts["prompt_moved"] and facts["prompt_shrink"] < 0.99, facts
    assert facts["task2_last"] < 0.5 * facts["task2_first"], facts

    # The correct verdict: the optimizer steps weights that are frozen.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="frozen_weights_stepped",
            causes=("frozen_weights_stepped",),
            covers=("prompt_pool",),
        ),
    )


# -- pytorch/vision#1261: a detector's warm-up stepped per iteration --------------------


def train_detection_warmup(run_id: str, seed: int, epochs: int = 6, iters: int = 50) -> Outcome:
    """torchvision's detection reference: SGD lr 0.02, momentum 0.9, weight decay 1e-4;
    in the first epoch a linear warm-up from 1/1000 of the lr, stepped after every
    iteration (`train_one_epoch`'s own scheduler), and a `MultiStepLR` at epochs 4 and
    5 stepped once an epoch."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8400 + seed)
    model = TinyDetector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    epoch_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [4, 5], gamma=0.1)
    run = watch(run_id, model, optimizer)
    lrs, losses = [], []
    for epoch in range(epochs):
        warmup = None
        if epoch == 0:
            warmup = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=1e-3, total_iters=iters - 1
            )
        for _ in range(iters):
            loss = detection_loss(model, g)
            optimizer.zero_grad()
            loss.backward()
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if warmup is not None:
                warmup.step()
            run.step(loss)
            losses.append(loss.item())
        epoch_scheduler.step()
    run.close()
    return Outcome(
        {"model": run},
        {
            "first_lr": lrs[0],
            "lr_after_warmup": lrs[iters],
            "last_lr": lrs[-1],
            "first": mean(losses[:20]),
            "last": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_detection_warmup_stepped_every_iteration(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/vision/issues/1261"""
    outcome = train_detection_warmup(gradflow_env, seed)

    # 300 steps; the lr rose a thousandfold over the first epoch and was cut twice;
    # the detector learned.
    facts = outcome.facts
    assert outcome.runs["model"].steps == 300
    assert facts["first_lr"] < 1e-4 and facts["lr_after_warmup"] == pytest.approx(0.02)
    assert facts["last_lr"] == pytest.approx(2e-4), facts
    assert facts["last"] < 0.7 * facts["first"], facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)


# -- google/deepvariant#194: the loss stays high while the classifier improves ---------


def pileups(size: int, g: torch.Generator, templates: torch.Tensor, flip: float):
    """Pileup-like images of three genotypes; a share `flip` of the labels is wrong."""
    x, y = blobs(size, g, templates, noise=1.5)
    wrong = torch.rand(size, generator=g) < flip
    noisy = torch.where(wrong, torch.randint(0, 3, (size,), generator=g), y)
    return x, y, noisy


def train_pileup_classifier(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A small CNN over 6-channel pileup images, three genotype classes, labels with
    40 % noise (the loss cannot fall far), RMSprop (DeepVariant's optimizer) at lr 1e-3, under bf16
    autocast on the CPU."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8500 + seed)
    templates = torch.randn(3, 6, 12, 12, generator=g) * 0.8
    model = SmallCNN(classes=3, channels=6)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    held_x, held_y, _ = pileups(768, g, templates, 0.0)
    accs, losses = [], []
    for step in range(steps):
        x, _, noisy = pileups(32, g, templates, 0.4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), noisy)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
        if step in (99, 299):
            accs.append(accuracy(model, held_x, held_y))
    run.close()
    return Outcome(
        {"model": run},
        {
            "acc_100": accs[0],
            "acc_300": accs[1],
            "loss_mid": mean(losses[100:200]),
            "loss_last": mean(losses[-100:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_pileup_loss_stays_high_while_accuracy_improves(gradflow_server, gradflow_env, seed):
    """https://github.com/google/deepvariant/issues/194"""
    outcome = train_pileup_classifier(gradflow_env, seed)

    # The loss stays near 0.9 over the last two thirds, barely moving; the accuracy on
    # clean labels is high.
    facts = outcome.facts
    assert facts["loss_last"] > 0.7, facts
    assert facts["loss_last"] > 0.85 * facts["loss_mid"], facts
    assert facts["acc_300"] > 0.9, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)

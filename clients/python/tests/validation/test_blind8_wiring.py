"""Failures of the eighth set in how a model, its loss or its schedule is wired: a
time-series regressor whose output meets labels of another shape, a checkpointed
feature extractor that backward never reaches, a layer-wise lr decay applied on every
step, and a warm-up scheduler that multiplies the lr by its factor on every step."""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .support import SEEDS, Diagnosis, Outcome, assert_caught, moved, snapshot, watch

pytestmark = pytest.mark.validation


# -- timeseriesAI/tsai#22: a (N, 1) regression output against (N,) targets ---------------


class InceptionLite(nn.Module):
    """Three parallel 1-d convolutions of different widths, a global average pool and a
    regression head."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(1, 8, k, padding=k // 2) for k in (3, 5, 9)])
        self.bn = nn.BatchNorm1d(24)
        self.head = nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(torch.cat([c(x) for c in self.convs], 1)))
        return self.head(h.mean(-1))


def series(n: int, g: torch.Generator):
    """Noisy sinusoids of random amplitude and phase; the target is the frequency."""
    freq = torch.rand(n, generator=g) * 2 + 1
    amp = torch.rand(n, 1, generator=g) + 0.5
    t = torch.linspace(0, 6.28, 48)
    ph = torch.rand(n, 1, generator=g) * 6.28
    x = amp * torch.sin(freq[:, None] * t + ph) + 0.1 * torch.randn(n, 48, generator=g)
    return x.unsqueeze(1), freq


def fit_tsai(seed: int, steps: int, squeeze: bool, run_id: Optional[str] = None):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9300 + seed)
    model = InceptionLite()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    criterion = nn.MSELoss()
    run = watch(run_id, model, optimizer) if run_id else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            x, y = series(16, g)
            out = model(x)
            loss = criterion(out[:, 0] if squeeze else out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if run:
                run.step(loss)
    if run:
        run.close()
    model.eval()
    x, y = series(1000, g)
    with torch.no_grad():
        pred = model(x)[:, 0]
    return run, (1 - ((pred - y) ** 2).mean() / y.var()).item()


def train_tsai(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The targets come out of the dataset as (16,), the model's output is (16, 1);
    `nn.MSELoss()` broadcasts them to (16, 16). Adam with a one-cycle schedule (max lr
    1e-2), as `fit_one_cycle`. The same run with the output squeezed, unwatched, is
    the control."""
    run, r2 = fit_tsai(seed, steps, squeeze=False, run_id=run_id)
    _, control = fit_tsai(seed, steps, squeeze=True)
    return Outcome({"model": run}, {"r2": r2, "control_r2": control})


@pytest.mark.parametrize("seed", SEEDS)
def test_tsai_regression_output_broadcasts_against_the_targets(gradflow_server, gradflow_env, seed):
    """https://github.com/timeseriesAI/tsai/issues/22"""
    outcome = train_tsai(gradflow_env, seed)

    # The model learns the batch mean: R² near 0 on held-out series, where the same
    # run with matching shapes explains most of the variance.
    assert outcome.facts["r2"] < 0.1, outcome.facts
    assert outcome.facts["control_r2"] > 0.4, outcome.facts

    # PROTOCOL's table gives the kind one cause, its own name.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="loss_broadcasts", causes=("loss_broadcasts",)),
    )


# -- Lyken17/pytorch-memonger#4: checkpointed layers behind an input without grad ------


class CheckpointedNet(nn.Module):
    """A small CNN whose feature extractor runs as two checkpointed segments (the
    reentrant checkpoint, as memonger's `SublinearSequential`) to save memory, and a
    classifier after it."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for part in (self.features[:6], self.features[6:]):
            h = checkpoint(part, h, use_reentrant=True)
        return self.classifier(h)


def train_memonger(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """SGD 0.05 momentum 0.9 on 8x8 images of four classes; the images do not require
    grad, so the first checkpointed segment's output does not either, and backward
    never enters the feature extractor (PyTorch warns "None of the inputs have
    requires_grad=True")."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9400 + seed)
    protos = torch.randn(4, 1, 8, 8, generator=g)
    model = CheckpointedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = watch(run_id, model, optimizer)
    features = [p.detach().clone() for p in model.features.parameters()]
    before = snapshot(model.classifier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            y = torch.randint(0, 4, (32,), generator=g)
            x = protos[y] + 0.8 * torch.randn(32, 1, 8, 8, generator=g)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
    run.close()
    same = all(torch.equal(a, b) for a, b in zip(features, model.features.parameters()))
    return Outcome(
        {"model": run},
        {"features_unchanged": same, "classifier_moved": moved(before, model.classifier)},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_memonger_checkpoint_behind_an_input_without_grad(gradflow_server, gradflow_env, seed):
    """https://github.com/Lyken17/pytorch-memonger/issues/4"""
    outcome = train_memonger(gradflow_env, seed)

    # The feature extractor never changes; the classifier trains.
    assert outcome.facts["features_unchanged"], outcome.facts
    assert outcome.facts["classifier_moved"], outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="grad_stuck_zero",
            causes=("backward_not_reached", "grad_missing"),
            covers=("features",),
        ),
    )


# -- jaehyunnn/ViTPose_pytorch#20: the layer-wise lr decay is applied on every step ----


class PoseViT(nn.Module):
    """A tiny ViT over 4x4 patches of a 16x16 image and a heatmap head."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.patch = nn.Linear(16, dim)
        self.pos = nn.Parameter(torch.zeros(16, dim))
        self.blocks = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
                for _ in range(depth)
            ]
        )
        self.head = nn.Linear(dim, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = x.unfold(1, 4, 4).unfold(2, 4, 4).reshape(x.shape[0], 16, 16)
        h = self.patch(p) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(h).reshape(x.shape[0], 256)


def keypoint_images(n: int, g: torch.Generator):
    """A bright blob at a random place; the target is a Gaussian heatmap there."""
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    c = torch.randint(2, 14, (n, 2), generator=g).float()
    d2 = (yy - c[:, 0, None, None]) ** 2 + (xx - c[:, 1, None, None]) ** 2
    heat = torch.exp(-d2 / 4)
    img = heat + 0.3 * torch.randn(n, 16, 16, generator=g)
    return img, heat.reshape(n, 256)


def train_vitpose(run_id: str, seed: int, steps: int = 300, decay: float = 0.75) -> Outcome:
    """AdamW 5e-4 with one parameter group a layer (embedding, each block, the head)
    and layer-wise lr scales decay^(depth + 1 - layer); a linear warm-up sets every
    group's lr over the first 50 steps, after which the layer-decay wrapper
    multiplies each group's lr by its scale before every step instead of once."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9500 + seed)
    model = PoseViT()
    depth = len(model.blocks)
    layers = [list(model.patch.parameters()) + [model.pos]]
    layers += [list(b.parameters()) for b in model.blocks]
    layers += [list(model.head.parameters())]
    scales = [decay ** (depth + 1 - i) for i in range(depth + 2)]
    optimizer = torch.optim.AdamW(
        [{"params": ps, "lr": 5e-4, "scale": s} for ps, s in zip(layers, scales)],
        lr=5e-4,
        weight_decay=0.1,
    )
    run = watch(run_id, model, optimizer)
    blocks_before = None
    lrs = []
    for step in range(steps):
        x, y = keypoint_images(32, g)
        loss = F.mse_loss(model(x), y) * 100
        optimizer.zero_grad()
        loss.backward()
        if step < 50:
            for group in optimizer.param_groups:
                group["lr"] = 5e-4 * (step + 1) / 50 * group["scale"]
        else:
            for group in optimizer.param_groups:
                group["lr"] *= group["scale"]
        optimizer.step()
        run.step(loss)
        lrs.append([group["lr"] for group in optimizer.param_groups])
        if step == steps - 101:
            blocks_before = snapshot(model.blocks)
    run.close()
    peak = [max(lr[i] for lr in lrs) for i in range(len(scales))]
    return Outcome(
        {"model": run},
        {
            "backbone_floor": max(lrs[-1][i] / peak[i] for i in range(len(scales) - 1)),
            "head_lr": lrs[-1][-1],
            "blocks_moved_late": moved(blocks_before, model.blocks),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_vitpose_layer_decay_applied_on_every_step(gradflow_server, gradflow_env, seed):
    """https://github.com/jaehyunnn/ViTPose_pytorch/issues/20"""
    outcome = train_vitpose(gradflow_env, seed)

    # Every backbone group's lr falls under 1e-8 of its peak; the head's holds.
    facts = outcome.facts
    assert facts["backbone_floor"] < 1e-8, facts
    assert facts["head_lr"] == pytest.approx(5e-4), facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_decayed",), covers=("param group",)),
    )


# -- potterhsu/easy-faster-rcnn.pytorch#7: the warm-up factor compounds every step -----


class WarmUpMultiStepLR(torch.optim.lr_scheduler.LRScheduler):
    """The repository's scheduler as written against the old scheduler API: its
    `get_lr` scales each group's *current* lr, so under newer PyTorch, which calls
    `get_lr` on every step, the warm-up factor multiplies in again each time."""

    def __init__(self, optimizer, milestones, gamma=0.1, factor=1 / 3, num_iters=500):
        self.milestones, self.gamma, self.factor, self.num_iters = (
            milestones,
            gamma,
            factor,
            num_iters,
        )
        super().__init__(optimizer)

    def get_lr(self):
        if self.last_epoch < self.num_iters:
            alpha = self.last_epoch / self.num_iters
            factor = (1 - self.factor) * alpha + self.factor
        else:
            factor = 1.0
        decay = self.gamma ** sum(1 for m in self.milestones if m <= self.last_epoch)
        return [group["lr"] * factor * decay for group in self.optimizer.param_groups]


def train_faster_rcnn(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A detection head over pooled features (a class head and a box regressor,
    cross-entropy plus smooth L1), SGD 1e-3 momentum 0.9 wd 5e-4, the warm-up
    scheduler (factor 1/3 over 500 iterations, milestones 50k and 70k) stepped every
    iteration."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9600 + seed)
    protos = torch.randn(3, 32, generator=g)
    backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    model = nn.ModuleDict({"backbone": backbone, "cls": nn.Linear(64, 3), "box": nn.Linear(64, 4)})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    scheduler = WarmUpMultiStepLR(optimizer, milestones=[50000, 70000])
    run = watch(run_id, model, optimizer)
    lrs = []
    before = None
    for step in range(steps):
        y = torch.randint(0, 3, (32,), generator=g)
        boxes = torch.rand(32, 4, generator=g)
        x = protos[y] + 0.5 * torch.randn(32, 32, generator=g)
        x = x + boxes.repeat(1, 8)
        h = model["backbone"](x)
        loss = F.cross_entropy(model["cls"](h), y) + F.smooth_l1_loss(model["box"](h), boxes)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        run.step(loss)
        lrs.append(optimizer.param_groups[0]["lr"])
        if step == 99:
            before = snapshot(model)
    run.close()
    after = snapshot(model)
    change = max((after[k] - before[k]).abs().max().item() for k in after)
    return Outcome({"model": run}, {"lr_ratio": lrs[-1] / 1e-3, "late_change": change})


@pytest.mark.parametrize("seed", SEEDS)
def test_faster_rcnn_warmup_factor_compounds(gradflow_server, gradflow_env, seed):
    """https://github.com/potterhsu/easy-faster-rcnn.pytorch/issues/7"""
    outcome = train_faster_rcnn(gradflow_env, seed)

    # The lr ends far under 1e-8 of its start and the last 200 steps move nothing
    # measurable (weight decay and momentum included).
    facts = outcome.facts
    assert facts["lr_ratio"] < 1e-8, facts
    assert facts["late_change"] < 1e-6, facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_decayed",)),
    )

"""Vision cases of the seventh set: a detector that never zeroes its gradients, a
FixMatch step that clips the scaled gradients, a tracker whose decay check steps the
scheduler once per batch, a VQA model left in eval mode, and SAM's two backward passes
per step (healthy)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, watch

pytestmark = pytest.mark.validation


def blobs(n: int, g: torch.Generator, centers: torch.Tensor, noise: float = 1.0):
    """Points around one centre per class; the label is the centre's index."""
    y = torch.randint(0, centers.shape[0], (n,), generator=g)
    return centers[y] + noise * torch.randn(n, centers.shape[1], generator=g), y


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()


# -- IDEA-Research/DAB-DETR#58: `optimizer.zero_grad()` is missing ---------------------


class Detector(nn.Module):
    """A backbone and a fixed set of queries, each with a class head and a box head."""

    def __init__(self, queries: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.queries, self.classes = queries, classes
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.class_head = nn.Linear(64, queries * (classes + 1))
        self.box_head = nn.Linear(64, queries * 4)

    def forward(self, x: torch.Tensor):
        h = self.backbone(x)
        return (
            self.class_head(h).view(-1, self.queries, self.classes + 1),
            self.box_head(h).view(-1, self.queries, 4).sigmoid(),
        )


def detr_batch(n: int, g: torch.Generator, mix: torch.Tensor):
    labels = torch.randint(0, 4, (n, 4), generator=g)
    boxes = torch.rand(n, 4, 4, generator=g)
    x = torch.cat([F.one_hot(labels, 4).float().flatten(1), boxes.flatten(1)], 1) @ mix
    return x, labels, boxes


def detr_loss(model: Detector, x, labels, boxes) -> torch.Tensor:
    logits, pred = model(x)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + 5 * F.l1_loss(pred, boxes)


def train_detr(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """DAB-DETR's `train_one_epoch`: AdamW 1e-4 (weight decay 1e-4), `loss.backward()`,
    `clip_grad_norm_(model.parameters(), 0.1)`, `optimizer.step()`, and no
    `optimizer.zero_grad()` anywhere."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7100 + seed)
    mix = torch.randn(32, 16, generator=g) / 4
    model = Detector()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4)
    run = watch(run_id, model, optimizer)
    carried = []
    for step in range(steps):
        x, labels, boxes = detr_batch(32, g, mix)
        loss = detr_loss(model, x, labels, boxes)
        if step > 0:
            carried.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"carried_min": min(carried)})


@pytest.mark.parametrize("seed", SEEDS)
def test_dab_detr_never_zeroes_its_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/IDEA-Research/DAB-DETR/issues/58"""
    outcome = train_detr(gradflow_env, seed)

    # Every backward adds to the last step's (clipped) gradient: it is never zero.
    assert outcome.facts["carried_min"] > 0.05, outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )


# -- TorchSSL/TorchSSL#59: FixMatch clips the scaled gradients --------------------------


def train_fixmatch(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """FixMatch as TorchSSL: a supervised CE on a labelled batch, a CE on the strongly
    augmented unlabelled batch against the weak view's pseudo-labels above 0.95; SGD
    0.03 momentum 0.9 Nesterov; fp16 autocast (on the CPU here) with a GradScaler;
    `scaler.scale(loss).backward()`, then `clip_grad_norm_(model.parameters(), 5)` with
    no `scaler.unscale_`, then `scaler.step(optimizer)`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7200 + seed)
    centers = torch.randn(4, 16, generator=g) * 2
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True)
    scaler = torch.amp.GradScaler("cpu")
    run = watch(run_id, model, optimizer, scaler=scaler)
    cut_under_bound = []
    for _ in range(steps):
        xl, yl = blobs(16, g, centers)
        xu, _ = blobs(64, g, centers)
        with torch.autocast("cpu", dtype=torch.float16):
            sup = F.cross_entropy(model(xl).float(), yl)
            with torch.no_grad():
                probs = model(xu + 0.1 * torch.randn(xu.shape, generator=g)).float().softmax(-1)
            conf, pseudo = probs.max(-1)
            strong = model(xu + 0.5 * torch.randn(xu.shape, generator=g)).float()
            unsup = (F.cross_entropy(strong, pseudo, reduction="none") * (conf > 0.95)).mean()
            loss = sup + unsup
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 5.0).item()
        cut_under_bound.append(norm > 5.0 and norm / scale < 5.0)
        scaler.step(optimizer)
        scaler.update()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"cut_under_bound": mean([float(c) for c in cut_under_bound])})


@pytest.mark.parametrize("seed", SEEDS)
def test_fixmatch_clips_the_scaled_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/TorchSSL/TorchSSL/pull/59"""
    outcome = train_fixmatch(gradflow_env, seed)

    # On most steps the clip cuts gradients whose true norm is under its bound.
    assert outcome.facts["cut_under_bound"] > 0.8, outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="clip_before_unscale", causes=("clip_before_unscale",)),
    )


# -- amoudgl/pygoturn#16: the decay check steps the scheduler once per batch ------------


def train_goturn(run_id: str, seed: int, itrs: int = 60, batches: int = 5) -> Outcome:
    """GOTURN's loop: the previous and current crops' features in, the box out (L1);
    SGD 1e-3 momentum 0.9 weight decay 5e-4; `StepLR(optimizer, 1, 0.1)`. The check
    `itr > 0 and itr % lr_decay_step == 0` (every 20 iterations) sits in the loop over
    the batches of one iteration, which runs until `done`: at each decay point the lr
    is divided by 10 once per batch."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7300 + seed)
    mix = torch.randn(8, 64, generator=g) / 2
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.1)
    run = watch(run_id, model, optimizer)
    lrs, moved_late = [], []
    for itr in range(itrs):
        for _ in range(batches):
            boxes = torch.rand(16, 4, generator=g)
            prev = torch.rand(16, 4, generator=g)
            x = torch.cat([prev, boxes], 1) @ mix
            loss = F.l1_loss(model(x), boxes)
            before = model[0].weight.detach().clone()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
            lrs.append(optimizer.param_groups[0]["lr"])
            moved_late.append((model[0].weight - before).abs().max().item())
            if itr > 0 and itr % 20 == 0:
                scheduler.step()
    run.close()
    return Outcome(
        {"model": run}, {"lr_end": lrs[-1], "lr_start": lrs[0], "move_late": max(moved_late[210:])}
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_goturn_decay_steps_once_per_batch(gradflow_server, gradflow_env, seed):
    """https://github.com/amoudgl/pygoturn/issues/16"""
    outcome = train_goturn(gradflow_env, seed)

    # The lr ends ten orders of magnitude below its start; the last third of the
    # run moves no weight by more than a rounding error.
    facts = outcome.facts
    assert facts["lr_end"] <= 1e-9 * facts["lr_start"], facts
    assert facts["move_late"] < 1e-8, facts

    assert_caught(
        gradflow_server, outcome, Diagnosis(run="model", kind="lr_vanished", causes=("lr_decayed",))
    )


# -- facebookresearch/clevr-iep#22: `check_accuracy` leaves the model in eval mode -------


class VQA(nn.Module):
    """Image features with batch norm and dropout, a bag of question words, fused."""

    def __init__(self, vocab: int = 50, answers: int = 6) -> None:
        super().__init__()
        self.image = nn.Sequential(
            nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3)
        )
        self.question = nn.EmbeddingBag(vocab, 64)
        self.classifier = nn.Sequential(
            nn.Linear(64, 64),
            nn.BatchNorm1d(64),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(64, answers),
        )

    def forward(self, image, words):
        return self.classifier(self.image(image) * self.question(words))


def vqa_batch(n: int, g: torch.Generator, table: torch.Tensor):
    image = torch.randn(n, 32, generator=g)
    words = torch.randint(0, 50, (n, 5), generator=g)
    answer = (image[:, :6] * table[words[:, 0] % 6]).sum(-1).gt(0).long() * 3 + words[:, 0] % 3
    return image, words, answer


def train_vqa(run_id: str, seed: int, steps: int = 400) -> Outcome:
    """The program trainer: Adam 5e-4; every 100 iterations `check_accuracy` calls
    `set_mode('eval', ...)` and nothing sets 'train' again."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7400 + seed)
    table = torch.randn(6, 6, generator=g)
    model = VQA()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4)
    run = watch(run_id, model, optimizer)
    model.train()
    in_eval = 0
    for step in range(steps):
        image, words, answer = vqa_batch(64, g, table)
        loss = F.cross_entropy(model(image, words), answer)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        in_eval += not model.training
        if step > 0 and step % 100 == 0:
            model.eval()  # check_accuracy
            with torch.no_grad():
                model(*vqa_batch(256, g, table)[:2])
    run.close()
    return Outcome({"model": run}, {"steps_in_eval": in_eval})


@pytest.mark.parametrize("seed", SEEDS)
def test_clevr_iep_trains_on_in_eval_mode(gradflow_server, gradflow_env, seed):
    """https://github.com/facebookresearch/clevr-iep/pull/22"""
    outcome = train_vqa(gradflow_env, seed)

    # 299 of 400 steps train with dropout off and batch norm on its running statistics.
    assert outcome.facts["steps_in_eval"] >= 290, outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="model_in_eval_mode", causes=("left_in_eval",)),
    )


# -- davda54/sam#32: SAM, two backward passes and two clips per step (healthy) ----------


def train_sam(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """SAM over SGD 0.05 momentum 0.9 (rho 0.05), as the thread's loop: forward,
    backward, `clip_grad_norm_`, `first_step(zero_grad=True)` (climb to w + e(w)),
    forward and backward again, `clip_grad_norm_`, `second_step(zero_grad=True)` (back
    to w, and the base optimizer's step)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7500 + seed)
    centers = torch.randn(5, 20, generator=g) * 1.2
    model = nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = watch(run_id, model, base)
    params = list(model.parameters())
    held_x, held_y = blobs(1000, g, centers)
    before = accuracy(model, held_x, held_y)
    losses = []
    for _ in range(steps):
        x, y = blobs(64, g, centers)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 5.0)
        with torch.no_grad():  # first_step
            scale = 0.05 / (torch.stack([p.grad.norm() for p in params]).norm() + 1e-12)
            climbs = [p.grad * scale for p in params]
            for p, e in zip(params, climbs):
                p.add_(e)
        base.zero_grad()
        F.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(params, 5.0)
        with torch.no_grad():  # second_step
            for p, e in zip(params, climbs):
                p.sub_(e)
        base.step()
        base.zero_grad()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome({"model": run}, {"before": before, "after": accuracy(model, held_x, held_y)})


@pytest.mark.parametrize("seed", SEEDS)
def test_sam_two_backward_passes_per_step(gradflow_server, gradflow_env, seed):
    """https://github.com/davda54/sam/issues/32"""
    outcome = train_sam(gradflow_env, seed)

    # The classifier learned: held-out accuracy from chance to above 0.85.
    facts = outcome.facts
    assert facts["before"] < 0.5 and facts["after"] > 0.85, facts

    assert_silent(gradflow_server, outcome)

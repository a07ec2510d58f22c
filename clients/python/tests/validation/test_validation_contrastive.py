"""Contrastive learning: VSE++ left in eval mode after a mid-epoch validation, and a
healthy MoCo v2 whose loss rises while its queue fills, with a momentum encoder that
the optimizer holds but never steps (it moves by the EMA, by hand).
"""

from __future__ import annotations

from typing import List

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
    moved,
    snapshot,
    watch,
)

pytestmark = pytest.mark.validation

SIDE = 8


def image_encoder(dim: int) -> nn.Sequential:
    """A small CNN with batch norm and dropout, for 1x8x8 images."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(16 * (SIDE // 2) ** 2, dim),
    )


# -- VSE++: the encoders stay in eval mode after validation -------------------------------

CLASSES, VOCAB, CAPTION = 8, 24, 6


def image_caption_batch(size: int, g: torch.Generator):
    """Pairs of an image and its caption. The class decides the image's stroke (a row or
    a column at one of four places) and the caption's first two words; the rest of the
    caption is filler words."""
    classes = torch.randint(0, CLASSES, (size,), generator=g)
    images = 0.3 * torch.randn(size, 1, SIDE, SIDE, generator=g)
    for i, c in enumerate(classes.tolist()):
        place = 2 * (c % 4)
        if c < 4:
            images[i, 0, place : place + 2, :] += 1.0
        else:
            images[i, 0, :, place : place + 2] += 1.0
    captions = torch.randint(2 * CLASSES, VOCAB, (size, CAPTION), generator=g)
    captions[:, 0] = classes
    captions[:, 1] = CLASSES + classes
    return images, captions


class EncoderText(nn.Module):
    """vsepp's text encoder: word embeddings, a GRU, the last hidden state, l2-normed."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, dim, batch_first=True)

    def forward(self, captions: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(captions))
        return F.normalize(out[:, -1], dim=-1)


class EncoderImage(nn.Module):
    """vsepp's `EncoderImageFull` with `--finetune`: the CNN trains, then an fc layer,
    l2-normed."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.cnn = image_encoder(dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.cnn(images), dim=-1)


def contrastive_loss(im: torch.Tensor, s: torch.Tensor, margin: float = 0.2) -> torch.Tensor:
    """vsepp's `ContrastiveLoss` with `max_violation` (VSE++): the hardest negatives'
    hinges, summed."""
    scores = im @ s.t()
    diagonal = scores.diag().view(-1, 1)
    cost_s = (margin + scores - diagonal).clamp(min=0)
    cost_im = (margin + scores - diagonal.t()).clamp(min=0)
    eye = torch.eye(scores.size(0), dtype=torch.bool)
    cost_s = cost_s.masked_fill(eye, 0).max(1)[0]
    cost_im = cost_im.masked_fill(eye, 0).max(0)[0]
    return cost_s.sum() + cost_im.sum()


class VSE(nn.Module):
    """vsepp's `VSE` model object (an nn.Module here, so that it can be watched): the
    two encoders, its Adam optimizer (lr 2e-4), `train_start`/`val_start` switching
    the encoders' modes, and `train_emb` doing one clipped optimizer step."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.img_enc = EncoderImage(dim)
        self.txt_enc = EncoderText(dim)
        self.optimizer = torch.optim.Adam(self.parameters(), lr=0.0002)
        self.Eiters = 0

    def train_start(self) -> None:
        self.img_enc.train()
        self.txt_enc.train()

    def val_start(self) -> None:
        self.img_enc.eval()
        self.txt_enc.eval()

    def train_emb(self, images: torch.Tensor, captions: torch.Tensor) -> torch.Tensor:
        self.Eiters += 1
        loss = contrastive_loss(self.img_enc(images), self.txt_enc(captions))
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.parameters(), 2.0)
        self.optimizer.step()
        return loss


def recall_at_1(model: VSE, g: torch.Generator) -> float:
    """Image-to-caption recall@1 on 64 held-out pairs (classes repeat, so a caption of
    the same class counts as a hit)."""
    images, captions = image_caption_batch(64, g)
    with torch.no_grad():
        best = (model.img_enc(images) @ model.txt_enc(captions).t()).argmax(1)
    return (captions[best, 0] == captions[:, 0]).float().mean().item()


def train_vse_left_in_eval(run_id: str, seed: int, epochs: int = 3) -> Outcome:
    """vsepp's `train()`: `model.train_start()` once at the start of each epoch, and a
    validation every `val_step` iterations that calls `model.val_start()` and never
    switches back. Epochs of 100 batches of 32, `val_step` 40: from the first
    validation on, most of each epoch trains in eval mode (batch norm on its running
    statistics, dropout off)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(500 + seed)
    model = VSE()
    bn = model.img_enc.cnn[1]
    run = watch(run_id, model, model.optimizer)
    in_eval, frozen_stats = 0, []
    for _ in range(epochs):
        model.train_start()
        stats_at_validation = None
        for _ in range(100):
            images, captions = image_caption_batch(32, g)
            loss = model.train_emb(images, captions)
            run.step(loss)
            in_eval += not model.img_enc.training
            if model.Eiters % 40 == 0:
                model.val_start()
                recall_at_1(model, g)
                stats_at_validation = bn.running_mean.clone()
        frozen_stats.append(torch.equal(bn.running_mean, stats_at_validation))
    run.close()
    return Outcome({"model": run}, {"steps_in_eval": in_eval, "stats_frozen": frozen_stats})


@pytest.mark.parametrize("seed", SEEDS)
def test_vse_encoders_left_in_eval_mode(gradflow_server, gradflow_env, seed):
    """https://github.com/fartashf/vsepp/issues/4"""
    outcome = train_vse_left_in_eval(gradflow_env, seed)

    facts = outcome.facts
    # Most optimizer steps ran with the encoders in eval mode: batch norm's running
    # statistics did not move from each validation to the end of its epoch.
    assert facts["steps_in_eval"] >= 180, facts
    assert all(facts["stats_frozen"]), facts

    # The correct verdict: the model trains in eval mode (PROTOCOL: model_in_eval_mode,
    # cause left_in_eval, subject `model`). Here the encoders, every module with
    # parameters, are in eval mode while the wrapper's own flag stays True, as in
    # vsepp, where `val_start` switches the encoders.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model", kind="model_in_eval_mode", causes=("left_in_eval",), covers=("model",)
        ),
    )


# -- MoCo v2: the loss rises while the queue fills ---------------------------------------


def random_pictures(size: int, g: torch.Generator) -> torch.Tensor:
    """Pictures of three random bright strokes (three pixels long, across or down) on
    noise: every picture its own."""
    pictures = 0.2 * torch.randn(size, 1, SIDE, SIDE, generator=g)
    rows = torch.randint(0, SIDE - 2, (size, 3, 1), generator=g)
    cols = torch.randint(0, SIDE - 2, (size, 3, 1), generator=g)
    across = torch.rand(size, 3, 1, generator=g) < 0.5
    along = torch.arange(3).view(1, 1, 3)
    rows = rows + torch.where(across, 0, along)
    cols = cols + torch.where(across, along, 0)
    which = torch.arange(size).view(size, 1, 1).expand_as(rows)
    pictures[:, 0].index_put_((which, rows, cols), torch.ones(rows.shape), accumulate=True)
    return pictures


def augment(pictures: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Brightness and contrast jitter, and noise."""
    scale = 0.8 + 0.4 * torch.rand(pictures.size(0), 1, 1, 1, generator=g)
    offset = 0.2 * torch.randn(pictures.size(0), 1, 1, 1, generator=g)
    return pictures * scale + offset + 0.1 * torch.randn(pictures.shape, generator=g)


class MoCo(nn.Module):
    """MoCo v2 as the official code builds it: a query encoder with an MLP head, a key
    encoder copied from it with `requires_grad = False` and moved by
    `_momentum_update_key_encoder`, and a queue of K normalised keys, initialised at
    random."""

    def __init__(self, dim: int = 16, queue: int = 1024, m: float = 0.99, t: float = 0.2) -> None:
        super().__init__()
        self.m, self.t = m, t
        self.encoder_q = nn.Sequential(image_encoder(32), nn.ReLU(), nn.Linear(32, dim))
        self.encoder_k = nn.Sequential(image_encoder(32), nn.ReLU(), nn.Linear(32, dim))
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self) -> None:
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        ptr = int(self.queue_ptr)
        self.queue[:, ptr : ptr + keys.shape[0]] = keys.T
        self.queue_ptr[0] = (ptr + keys.shape[0]) % self.queue.shape[1]

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", q, self.queue.clone().detach())
        logits = torch.cat([l_pos, l_neg], dim=1) / self.t
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


def instance_accuracy(model: MoCo, pictures: torch.Tensor, g: torch.Generator) -> float:
    """Held-out instance discrimination: how often a picture's augmented view is
    closest, among 256 held-out pictures' views, to another view of itself."""
    was = model.training
    model.eval()
    with torch.no_grad():
        a = F.normalize(model.encoder_q(augment(pictures, g)), dim=1)
        b = F.normalize(model.encoder_q(augment(pictures, g)), dim=1)
    model.train(was)
    return ((a @ b.t()).argmax(1) == torch.arange(len(pictures))).float().mean().item()


def train_moco(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The thread's MoCo v2 settings: SGD lr 0.03, momentum 0.9, weight decay 1e-4,
    a cosine schedule, T 0.2, key-encoder momentum 0.99; the optimizer is given
    `model.parameters()`, the key encoder's included, as the official code does.
    Batches of 32, a queue of 1024 keys (full after 32 steps)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(600 + seed)
    held_out = random_pictures(256, g)
    model = MoCo()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    before_acc = instance_accuracy(model, held_out, g)
    key_before = snapshot(model.encoder_k)
    run = watch(run_id, model, optimizer)
    losses: List[float] = []
    for _ in range(steps):
        pictures = random_pictures(32, g)
        logits, labels = model(augment(pictures, g), augment(pictures, g))
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"moco": run},
        {
            "accuracy_before": before_acc,
            "accuracy_after": instance_accuracy(model, held_out, g),
            "loss_first": mean(losses[:5]),
            "loss_peak": max(losses[:80]),
            "key_encoder_moved": len(moved(key_before, model.encoder_k)),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_moco_loss_rises_while_the_queue_fills(gradflow_server, gradflow_env, seed):
    """https://github.com/DTennant/CL-Visualizing-Feature-Transformation/issues/1"""
    outcome = train_moco(gradflow_env, seed)

    facts = outcome.facts
    # Alarming: the loss climbs as real keys replace the random ones in the queue ...
    assert facts["loss_peak"] > 1.1 * facts["loss_first"], facts
    # ... the key encoder moves with no gradient (by the EMA) ...
    assert facts["key_encoder_moved"] > 0, facts
    # ... and the query encoder learned to tell held-out pictures apart.
    assert facts["accuracy_after"] > facts["accuracy_before"] + 0.1, facts

    assert_silent(gradflow_server, outcome)

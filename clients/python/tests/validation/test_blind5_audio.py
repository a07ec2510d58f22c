"""Audio (the fifth set): RETURNN's PyTorch updater, which clips the global norm of
the gradients while the AMP GradScaler still has them scaled, and WeKws' keyword
spotting loop, which never zeroes its gradients.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, mean, watch

pytestmark = pytest.mark.validation

MELS, FRAMES, PHONES = 16, 24, 8


def utterances(size: int, g: torch.Generator, templates: torch.Tensor):
    """Frame-wise labelled features: each frame is its phone's template plus noise;
    phones last 4 frames."""
    labels = torch.randint(0, PHONES, (size, FRAMES // 4), generator=g).repeat_interleave(4, 1)
    feats = templates[labels] + torch.randn(size, FRAMES, MELS, generator=g) * 0.8
    return feats.transpose(1, 2), labels


class TDNN(nn.Module):
    def __init__(self, hidden: int = 48) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv1d(MELS, hidden, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(hidden, hidden, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(hidden, PHONES, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


# -- rwth-i6/returnn#1590: the global-norm clip sees scaled gradients ------------------


def train_returnn_amp(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """RETURNN's torch `Updater` with `torch_amp = "float16"` (here under CPU
    autocast) and `gradient_clip_global_norm = 5`: `grad_scaler.scale(loss).backward()`,
    then `clip_grad_norm_(params, 5)`, then `grad_scaler.step(optimizer)`; Adam lr
    1e-3, frame-wise cross-entropy, batch 4."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6700 + seed)
    templates = torch.randn(PHONES, MELS, generator=g)
    model = TDNN(hidden=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    run = watch(run_id, model, optimizer, scaler=scaler)
    true_norms: List[float] = []
    used_norms: List[float] = []
    for _ in range(steps):
        feats, labels = utterances(4, g, templates)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(feats).float(), labels)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        true_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)) / scale)
        used_norms.append(
            torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()])
            ).item()
            / scale
        )
        scaler.step(optimizer)
        scaler.update()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"true_norm": mean(true_norms), "used_norm": mean(used_norms)})


@pytest.mark.parametrize("seed", SEEDS)
def test_returnn_clips_the_scaled_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/rwth-i6/returnn/issues/1590"""
    outcome = train_returnn_amp(gradflow_env, seed)

    # The gradients were below the bound of 5 and should not have been clipped at
    # all; clipped while scaled, the steps used gradients thousands of times smaller.
    facts = outcome.facts
    assert facts["true_norm"] < 5.0, facts
    assert facts["used_norm"] < 1e-3 * facts["true_norm"], facts

    # The correct verdict (PROTOCOL: clip_before_unscale on `gradients`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="clip_before_unscale",
            causes=("clip_before_unscale",),
            covers=("gradients",),
        ),
    )


# -- wenet-e2e/wekws#73: the executor never zeroes the gradients ---------------------


class KeywordSpotter(nn.Module):
    """WeKws' small model in spirit: a linear preprocessing layer, a GRU backbone, a
    sigmoid keyword posterior per frame."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.preprocessing = nn.Linear(MELS, hidden)
        self.backbone = nn.GRU(hidden, hidden, batch_first=True)
        self.classifier = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.backbone(F.relu(self.preprocessing(x)))
        return torch.sigmoid(self.classifier(h)).squeeze(-1)


def keyword_batch(size: int, g: torch.Generator, keyword: torch.Tensor):
    """Utterances of noise; half of them hold the keyword (4 frames) somewhere."""
    feats = torch.randn(size, FRAMES, MELS, generator=g)
    labels = torch.randint(0, 2, (size,), generator=g)
    for i in range(size):
        if labels[i]:
            start = int(torch.randint(0, FRAMES - 4, (1,), generator=g))
            feats[i, start : start + 4] += keyword
    return feats, labels


def max_pooling_loss(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """WeKws' max-pooling loss: the utterance's highest frame posterior against its label."""
    peak = probs.max(1).values.clamp(1e-6, 1 - 1e-6)
    return F.binary_cross_entropy(peak, labels.float())


def train_wekws(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """kws/utils/executor.py before the fix: `loss.backward()`, `grad_norm =
    clip_grad_norm_(model.parameters(), 5)`, `if torch.isfinite(grad_norm):
    optimizer.step()`, and no `zero_grad` anywhere; Adam lr 1e-3, weight decay 1e-4,
    batch 32."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(6800 + seed)
    keyword = torch.randn(4, MELS, generator=g) * 1.5
    model = KeywordSpotter()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    run = watch(run_id, model, optimizer)
    held: List[float] = []
    for _ in range(steps):
        feats, labels = keyword_batch(32, g, keyword)
        loss = max_pooling_loss(model(feats), labels)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        if torch.isfinite(grad_norm):
            optimizer.step()
        run.step(loss)
        held.append(model.classifier.weight.grad.norm().item())
    run.close()
    stale = model.classifier.weight.grad.norm().item()
    model.zero_grad()
    feats, labels = keyword_batch(32, g, keyword)
    max_pooling_loss(model(feats), labels).backward()
    return Outcome(
        {"model": run},
        {
            "stale_norm": stale,
            "fresh_norm": model.classifier.weight.grad.norm().item(),
            "early_norm": mean(held[:10]),
            "late_norm": mean(held[-10:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_wekws_never_zeroes_its_gradients(gradflow_server, gradflow_env, seed):
    """https://github.com/wenet-e2e/wekws/pull/73"""
    outcome = train_wekws(gradflow_env, seed)

    # The gradient the last step held is the pile of all of them (kept under 5 by the
    # clip, which cuts the pile in place), far above one batch's own.
    facts = outcome.facts
    assert facts["stale_norm"] > 3 * facts["fresh_norm"], facts

    # The correct verdict (PROTOCOL: grads_not_zeroed, cause not_zeroed).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )

"""Sequence models (the third set): Onsets and Frames, a piano transcriber with
bidirectional LSTMs, clips its gradients after `optimizer.step()`, where the clip
acts on gradients already used.

The "audio" is a random piano roll rendered into a noisy 16-bin spectrogram.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, watch

pytestmark = pytest.mark.validation

KEYS, BINS, FRAMES = 8, 16, 32


def piano_batch(size: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    """Notes of 3 to 8 frames; each key lights two spectrogram bins, louder at onset."""
    frames = torch.zeros(size, FRAMES, KEYS)
    onsets = torch.zeros(size, FRAMES, KEYS)
    for i in range(size):
        for _ in range(4):
            key = int(torch.randint(0, KEYS, (1,), generator=g))
            start = int(torch.randint(0, FRAMES - 3, (1,), generator=g))
            length = int(torch.randint(3, 9, (1,), generator=g))
            frames[i, start : start + length, key] = 1
            onsets[i, start, key] = 1
    render = torch.zeros(KEYS, BINS)
    for key in range(KEYS):
        render[key, 2 * key] = 1.0
        render[key, 2 * key + 1] = 0.5
    mel = (frames + onsets) @ render + 0.3 * torch.randn(size, FRAMES, BINS, generator=g)
    return {"mel": mel, "frame": frames, "onset": onsets}


class OnsetsAndFrames(nn.Module):
    """The model's two stacks in small: an onset stack (a convolutional front end and
    a BiLSTM) and a frame stack whose BiLSTM also reads the onset predictions."""

    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.onset_stack = nn.ModuleDict(
            {
                "conv": nn.Conv1d(BINS, hidden, 3, padding=1),
                "lstm": nn.LSTM(hidden, hidden // 2, batch_first=True, bidirectional=True),
                "fc": nn.Linear(hidden, KEYS),
            }
        )
        self.frame_conv = nn.Conv1d(BINS, hidden, 3, padding=1)
        self.combined_lstm = nn.LSTM(
            hidden + KEYS, hidden // 2, batch_first=True, bidirectional=True
        )
        self.frame_fc = nn.Linear(hidden, KEYS)

    def forward(self, mel: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = mel.transpose(1, 2)
        onset_features = F.relu(self.onset_stack["conv"](x)).transpose(1, 2)
        onset = self.onset_stack["fc"](self.onset_stack["lstm"](onset_features)[0])
        frame_features = F.relu(self.frame_conv(x)).transpose(1, 2)
        combined = torch.cat([frame_features, torch.sigmoid(onset).detach()], -1)
        frame = self.frame_fc(self.combined_lstm(combined)[0])
        return onset, frame


def train_onsets_and_frames(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The repository's train.py: Adam lr 6e-4, StepLR(10000, 0.98), the onset and
    frame BCE losses summed, and after `optimizer.step()` and `scheduler.step()`,
    `clip_grad_norm_(model.parameters(), clip_gradient_norm=3)`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8100 + seed)
    model = OnsetsAndFrames()
    optimizer = torch.optim.Adam(model.parameters(), lr=6e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10000, gamma=0.98)
    run = watch(run_id, model, optimizer)
    clipped: List[float] = []
    losses: List[float] = []
    for _ in range(steps):
        batch = piano_batch(8, g)
        onset, frame = model(batch["mel"])
        loss = F.binary_cross_entropy_with_logits(
            onset, batch["onset"]
        ) + F.binary_cross_entropy_with_logits(frame, batch["frame"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        clipped.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)))
        losses.append(loss.item())
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "clip_saw_gradients": min(clipped) > 0,
            "steps_above_clip": sum(n > 3.0 for n in clipped),
            "loss_first": sum(losses[:20]) / 20,
            "loss_last": sum(losses[-20:]) / 20,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_onsets_and_frames_clips_after_the_step(gradflow_server, gradflow_env, seed):
    """https://github.com/jongwook/onsets-and-frames/issues/24"""
    outcome = train_onsets_and_frames(gradflow_env, seed)

    # The clip found, on every step, the gradients the optimizer had just used (it
    # measured them above 0); whatever it cut, the next `zero_grad` threw away. The
    # transcriber trains (as the maintainer says, the norm stays mostly under 3).
    facts = outcome.facts
    assert facts["clip_saw_gradients"], facts
    assert facts["loss_last"] < 0.7 * facts["loss_first"], facts

    # The correct verdict: `clip_grad_norm_` ran after `optimizer.step()`, on gradients
    # the step had already used (PROTOCOL: clip_after_step, subject `gradients`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="clip_after_step", causes=("clip_after_step",)),
    )

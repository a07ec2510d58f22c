"""Transformers (the fifth set): OpenPrompt's tutorial, whose optimizer and linear
schedule step on every micro-batch although the schedule was sized in accumulated
steps; UMS-ResSel's post-training, which clips after the optimizer step; and a healthy
causal LM trained by the Hugging Face `Trainer` whose loss climbs through the warm-up
before it falls.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import transformers
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
from .test_blind3_transformers import VOCAB, marker_documents, tiny_bert_classifier

pytestmark = pytest.mark.validation


# -- thunlp/OpenPrompt#106: the optimizer and scheduler step outside the accumulation --


class SoftPromptClassifier(nn.Module):
    """A prompt model in small: soft template tokens before the text, a tiny
    transformer encoder as the PLM, an MLM head read at the mask position, and a
    verbalizer of two label words."""

    def __init__(self, dim: int = 32, prompt: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.soft_template = nn.Parameter(torch.randn(prompt, dim) * 0.1)
        layer = nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.plm = nn.TransformerEncoder(layer, 1)
        self.mlm_head = nn.Linear(dim, VOCAB)
        self.label_words = (3, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = torch.cat([self.soft_template.expand(x.shape[0], -1, -1), x], 1)
        logits = self.mlm_head(self.plm(x)[:, 0])
        return logits[:, list(self.label_words)]


def train_openprompt(run_id: str, seed: int, micro_batches: int = 600) -> Outcome:
    """Tutorial 4.1's loop: `gradient_accumulation_steps = 4`, `tot_step` = the
    accumulated steps (micro-batches / 4), AdamW (lr 1e-3 for the tiny model; no decay
    on biases and LayerNorm weights, 0.01 on the rest) with
    `get_linear_schedule_with_warmup(num_warmup_steps=0, num_training_steps=tot_step)`;
    the clip sits in the accumulation branch, `optimizer1.step()`,
    `optimizer1.zero_grad()` and `scheduler1.step()` after it, on every micro-batch."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7000 + seed)
    model = SoftPromptClassifier()
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "norm" in n)]
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    optimizer1 = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
    )
    accumulation = 4
    tot_step = micro_batches // accumulation
    scheduler1 = transformers.get_linear_schedule_with_warmup(optimizer1, 0, tot_step)
    run = watch(run_id, model, optimizer1)
    lrs: List[float] = []
    middle = None
    for actual_step in range(1, micro_batches + 1):
        tokens, labels = marker_documents(16, g)
        loss = F.cross_entropy(model(tokens), labels) / accumulation
        loss.backward()
        if actual_step % accumulation == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer1.step()
        optimizer1.zero_grad()
        scheduler1.step()
        run.step(loss)
        lrs.append(optimizer1.param_groups[0]["lr"])
        if actual_step == micro_batches // 2:
            middle = snapshot(model)
    run.close()
    return Outcome(
        {"model": run},
        {
            "share_at_zero": mean([float(lr == 0) for lr in lrs]),
            "moved_in_second_half": sorted(moved(middle, model)),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_openprompt_schedule_ends_a_quarter_into_the_run(gradflow_server, gradflow_env, seed):
    """https://github.com/thunlp/OpenPrompt/issues/106"""
    outcome = train_openprompt(gradflow_env, seed)

    # The schedule sized for 150 accumulated steps ran out after 150 micro-batches:
    # the lr is 0 for three quarters of the run and no weight moves in its second half.
    facts = outcome.facts
    assert facts["share_at_zero"] > 0.7, facts
    assert facts["moved_in_second_half"] == [], facts

    # The correct verdict (PROTOCOL: lr_vanished on `run`, every group's lr exactly 0:
    # cause lr_zero, a schedule built for fewer steps than the loop runs).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_zero",), covers=("run",)),
    )


# -- taesunwhang/UMS-ResSel#3: post-training clips after the step ----------------------


def train_ums_post_training(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """post_train/post_training.py's update: `loss.backward()`, `optimizer.step()`,
    then `torch.nn.utils.clip_grad_norm_(model.parameters(), max_gradient_norm)` (1.0
    here), `optimizer.zero_grad()` on the next batch; AdamW lr 3e-5 scaled to 1e-3 for
    the tiny BERT, a linear decay, batch 32."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7100 + seed)
    model = tiny_bert_classifier()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, steps)
    run = watch(run_id, model, optimizer)
    used: List[float] = []
    for _ in range(steps):
        tokens, labels = marker_documents(32, g)
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        used.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"share_above_bound": mean([float(n > 1.0) for n in used])})


@pytest.mark.parametrize("seed", SEEDS)
def test_ums_post_training_clips_after_the_step(gradflow_server, gradflow_env, seed):
    """https://github.com/taesunwhang/UMS-ResSel/issues/3"""
    outcome = train_ums_post_training(gradflow_env, seed)

    # Some steps used gradients above the bound the clip was meant to hold them to;
    # the clip then cut gradients already used.
    assert outcome.facts["share_above_bound"] > 0.02, outcome.facts

    # The correct verdict (PROTOCOL: clip_after_step on `gradients`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model", kind="clip_after_step", causes=("clip_after_step",), covers=("gradients",)
        ),
    )


# -- lm-sys/FastChat#300: the Trainer's loss climbs through the warm-up, then falls ----


class Sequences(torch.utils.data.Dataset):
    def __init__(self, size: int, g: torch.Generator) -> None:
        # Counting sequences: a start and a stride, then start + k * stride mod 32.
        start = torch.randint(0, 32, (size, 1), generator=g)
        stride = torch.randint(1, 4, (size, 1), generator=g)
        self.ids = (start + stride * torch.arange(16)) % 32

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_with_trainer(run_id: str, seed: int, tmp_path) -> Outcome:
    """Fine-tuning as FastChat's train.py runs it, through `transformers.Trainer`: a
    tiny random GPT-2 on 400 counting sequences, 3 epochs of batch 4 (300 steps),
    AdamW with a cosine schedule after 100 warm-up steps to a high lr (0.1, the
    thread's 2e-5 scaled far up for the tiny model), `max_grad_norm` 1; the run is
    watched by gradflow's `GradflowCallback`."""
    from gradflow.integrations.transformers import GradflowCallback

    from .support import Run, dry

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7200 + seed)
    config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    data = Sequences(400, g)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_train_epochs=3,
        learning_rate=1e-1,
        warmup_steps=100,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    options = {"on_alert": None} if dry() else {}
    if dry():
        import warnings

        warnings.simplefilter("ignore")
    callback = GradflowCallback(run_id=run_id, **options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    run = Run(run_id, steps=trainer.state.global_step)
    return Outcome(
        {"model": run},
        {
            "steps": trainer.state.global_step,
            "low_early": min(mean(losses[i : i + 5]) for i in range(0, 30)),
            "peak": max(mean(losses[i : i + 5]) for i in range(30, 150)),
            "last": mean(losses[-10:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_trainer_loss_climbs_through_the_warmup(gradflow_server, gradflow_env, seed, tmp_path):
    """https://github.com/lm-sys/FastChat/issues/300"""
    outcome = train_with_trainer(gradflow_env, seed, tmp_path)

    # The loss climbed well above its early low as the lr warmed up, then fell below
    # that low as the schedule decayed.
    facts = outcome.facts
    assert facts["steps"] == 300, facts
    assert facts["peak"] > 1.2 * facts["low_early"], facts
    assert facts["last"] < 0.9 * facts["low_early"], facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)

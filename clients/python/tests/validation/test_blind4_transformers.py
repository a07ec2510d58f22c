"""transformers (the fourth set): BERT sequence classification whose warm-up schedule
is asked for the learning rate of its last step at every step, so that the lr it
sets is 0 from the first step on.

The model is the third set's tiny `BertForSequenceClassification` with random
weights (2 layers, hidden size 32); the task is whether a marker token occurs in the sequence.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch

from .support import SEEDS, Diagnosis, Outcome, assert_caught, snapshot, watch
from .test_blind3_transformers import LENGTH, VOCAB, tiny_bert_classifier

pytestmark = pytest.mark.validation

MARKER = 7


def marker_batch(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(10, VOCAB, (size, LENGTH), generator=g)
    labels = torch.randint(0, 2, (size,), generator=g)
    for i in range(size):
        if labels[i]:
            tokens[i, int(torch.randint(1, LENGTH, (1,), generator=g))] = MARKER
    tokens[:, 0] = 2  # [CLS]
    return tokens, labels


def warmup_linear(progress: float, warmup: float) -> float:
    """pytorch_pretrained_bert's `warmup_linear` (0.6.x): a linear warm-up over the
    first `warmup` share of training, then a linear decay to 0 at `t_total`."""
    if progress < warmup:
        return progress / warmup
    return max((progress - 1.0) / (warmup - 1.0), 0.0)


def train_bert_kernel(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The Kaggle kernel the thread runs: `num_train_optimization_steps` = the run's
    steps, warm-up proportion 0.1, and at every step
    `lr_this_step = learning_rate * warmup_linear.get_lr(num_train_optimization_steps,
    warmup_proportion)` written into each parameter group: the schedule is asked for
    its last step, not the current one (the library warns 'Training beyond specified
    t_total'). Adam with weight decay 0.01 (BertAdam's place), lr 2e-5 scaled to 1e-3
    for the tiny model, batch 16."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5300 + seed)
    model = tiny_bert_classifier()
    model.train()
    learning_rate, warmup_proportion = 1e-3, 0.1
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    lrs = []
    num_train_optimization_steps = steps
    for _ in range(steps):
        tokens, labels = marker_batch(16, g)
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        progress = num_train_optimization_steps / num_train_optimization_steps
        lr_this_step = learning_rate * warmup_linear(progress, warmup_proportion)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_this_step
        optimizer.step()
        optimizer.zero_grad()
        lrs.append(lr_this_step)
        run.step(loss)
    run.close()
    moved = [
        name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])
    ]
    return Outcome({"model": run}, {"lrs": set(lrs), "moved": moved})


@pytest.mark.parametrize("seed", SEEDS)
def test_bert_warmup_schedule_asked_for_its_last_step(gradflow_server, gradflow_env, seed):
    """https://github.com/huggingface/transformers/issues/587"""
    outcome = train_bert_kernel(gradflow_env, seed)

    # The lr was 0 on every step: not one weight of the model changed.
    facts = outcome.facts
    assert facts["lrs"] == {0.0}, facts["lrs"]
    assert facts["moved"] == [], facts["moved"][:5]

    # The correct verdict: the lr is exactly 0, the schedule's end reached before the
    # loop's (PROTOCOL: lr_vanished, cause lr_zero, subject `run` as the one group
    # with an lr vanished).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_zero",), covers=("run",)),
    )

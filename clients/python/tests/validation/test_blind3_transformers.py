"""Transformers fine-tuning (the third set): a DistilBERT document regression head
whose squeezed predictions meet unsqueezed labels in an element-wise MSE, so every
prediction is compared with every label of the batch; a T5 translation run whose
prepared scheduler steps once per process at every optimizer step; a BERT classifier
whose embeddings were "frozen" with a module attribute; and, healthy, a BERT frozen on
purpose so that its classifier alone trains.

The models are tiny, with random weights; a document's regression target is how
often two marker tokens occur in it, standardised.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, watch

pytestmark = pytest.mark.validation

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, MARKERS = 64, 16, (5, 9)


def documents(size: int, g: torch.Generator):
    tokens = torch.randint(1, VOCAB, (size, LENGTH), generator=g)
    counts = sum((tokens == m).sum(1) for m in MARKERS).float()
    # Standardised as FARM's processor scales regression labels; shape (size, 1), as
    # the processor builds its label tensors.
    return tokens, ((counts - 0.5) / 0.7).unsqueeze(1)


class DocRegression(nn.Module):
    """FARM's AdaptiveModel in small: a language model, the first token's vector and a
    RegressionHead (a feed-forward [dim, 1]) whose logits are squeezed, as FARM #230
    found they were."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            hidden_dim=64,
            n_layers=2,
            n_heads=2,
            max_position_embeddings=LENGTH,
        )
        self.language_model = transformers.DistilBertModel(config)
        self.head = nn.Linear(32, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.language_model(input_ids=tokens).last_hidden_state[:, 0]
        return self.head(hidden).squeeze(-1)


def r_squared(model: DocRegression, g: torch.Generator) -> float:
    tokens, labels = documents(512, g)
    model.eval()
    with torch.no_grad():
        predicted = model(tokens)
    model.train()
    labels = labels.squeeze(1)
    return 1 - ((predicted - labels) ** 2).mean().item() / labels.var().item()


def train_farm_regression(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The thread's run: distilBERT with `RegressionHead([768, 1])`, batch 32, AdamW
    (lr 1e-3 for the tiny random model). The head's loss is
    `MSELoss(reduction="none")(logits, label_ids)` with logits (32,) and labels (32, 1):
    a (32, 32) matrix, averaged into the step's loss."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5100 + seed)
    model = DocRegression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fct = nn.MSELoss(reduction="none")
    run = watch(run_id, model, optimizer)
    shapes = set()
    for _ in range(steps):
        tokens, labels = documents(32, g)
        per_sample = loss_fct(model(tokens), labels)
        shapes.add(tuple(per_sample.shape))
        loss = per_sample.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"loss_shapes": shapes, "r_squared": r_squared(model, g)})


@pytest.mark.parametrize("seed", SEEDS)
def test_farm_regression_head_loss_broadcasts(gradflow_server, gradflow_env, seed):
    """https://github.com/deepset-ai/FARM/issues/229"""
    outcome = train_farm_regression(gradflow_env, seed)

    # Every step's loss compared each of the 32 predictions with all 32 labels; the
    # best the head can do is the batch's mean, so it explains none of the targets.
    facts = outcome.facts
    assert facts["loss_shapes"] == {(32, 32)}, facts
    assert facts["r_squared"] < 0.1, facts

    # The correct verdict: an element-wise loss whose prediction and target broadcast
    # into 32 pairs per prediction (PROTOCOL: loss_broadcasts, subject `loss`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="loss_broadcasts", causes=("loss_broadcasts",)),
    )


# -- huggingface/transformers#26827: the schedule runs twice as fast on two processes --


def copy_task(size: int, g: torch.Generator):
    """A translation task in small: the target is the source reversed."""
    source = torch.randint(3, 32, (size, 8), generator=g)
    return source, source.flip(1)


def train_t5_no_trainer(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """run_translation_no_trainer.py on two processes: `get_scheduler("linear",
    num_warmup_steps=30, num_training_steps=max_train_steps)` then
    `accelerator.prepare(...)`. The prepared scheduler steps once per process at each
    optimizer step (accelerate's AcceleratedScheduler with `split_batches=False`); on
    this one process that is two `scheduler.step()` calls per step. A tiny T5 with
    random weights, AdamW 5e-4."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5200 + seed)
    config = transformers.T5Config(
        vocab_size=32,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    scheduler = transformers.get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=30, num_training_steps=steps
    )
    num_processes = 2
    run = watch(run_id, model, optimizer)
    lrs = []
    for _ in range(steps):
        source, target = copy_task(16, g)
        loss = model(input_ids=source, labels=target).loss
        loss.backward()
        optimizer.step()
        for _ in range(num_processes):
            scheduler.step()
        optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {"zero_lr_steps": sum(lr == 0 for lr in lrs), "peak_step": lrs.index(max(lrs))},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_t5_schedule_stepped_once_per_process(gradflow_server, gradflow_env, seed):
    """https://github.com/huggingface/transformers/issues/26827"""
    outcome = train_t5_no_trainer(gradflow_env, seed)

    # The warm-up peaks at step 15 instead of 30, and the lr is 0 for the second half of
    # the run, as the thread's plot shows.
    facts = outcome.facts
    assert facts["peak_step"] == 14, facts
    assert facts["zero_lr_steps"] >= 149, facts

    # The correct verdict names the cause: the scheduler advanced 2 steps at every
    # optimizer step, so the schedule runs twice as fast (PROTOCOL:
    # scheduler_per_micro_batch). Its symptom, an lr of exactly 0 over the second half
    # (lr_vanished, cause lr_zero), is as true; the set's rule counts it as another
    # kind.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="scheduler_per_micro_batch",
            causes=("scheduler_per_micro_batch",),
        ),
    )


# -- huggingface/transformers#95 and #400: freezing BERT's parts -----------------------


def tiny_bert_classifier() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def marker_documents(size: int, g: torch.Generator):
    """Documents labelled by their first token's half of the vocabulary (the pooled
    first position carries it even through a frozen random encoder)."""
    tokens, _ = documents(size, g)
    return tokens, (tokens[:, 0] < VOCAB // 2).long()


def classification_accuracy(model: nn.Module, g: torch.Generator) -> float:
    tokens, labels = marker_documents(512, g)
    model.eval()
    with torch.no_grad():
        right = (model(input_ids=tokens).logits.argmax(1) == labels).float().mean().item()
    model.train()
    return right


def train_bert_classifier(
    run_id: str, seed: int, freeze, lr: float = 1e-3, steps: int = 300
) -> Outcome:
    """BertForSequenceClassification, batch 32, Adam over `model.parameters()` (lr 1e-3
    for the tiny random model; a linear probe's 1e-2 when only the classifier trains);
    `freeze(model)` runs before the optimizer."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5300 + seed)
    model = tiny_bert_classifier()
    freeze(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    embeddings_before = model.bert.embeddings.word_embeddings.weight.detach().clone()
    encoder_before = model.bert.encoder.layer[0].attention.self.query.weight.detach().clone()
    before = classification_accuracy(model, g)
    run = watch(run_id, model, optimizer)
    for _ in range(steps):
        tokens, labels = marker_documents(32, g)
        loss = model(input_ids=tokens, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "embeddings_moved": not torch.equal(
                model.bert.embeddings.word_embeddings.weight, embeddings_before
            ),
            "encoder_moved": not torch.equal(
                model.bert.encoder.layer[0].attention.self.query.weight, encoder_before
            ),
            "before": before,
            "after": classification_accuracy(model, g),
        },
    )


def freeze_embeddings_by_attribute(model: nn.Module) -> None:
    # The thread's line: a plain attribute on the module; its parameters keep
    # requires_grad=True.
    model.bert.embeddings.requires_grad = False


@pytest.mark.parametrize("seed", SEEDS)
def test_bert_embeddings_freeze_flag_ignored(gradflow_server, gradflow_env, seed):
    """https://github.com/huggingface/transformers/issues/95"""
    outcome = train_bert_classifier(gradflow_env, seed, freeze_embeddings_by_attribute)

    # The embeddings the user meant to keep fixed were updated on every step.
    facts = outcome.facts
    assert facts["embeddings_moved"], facts
    assert facts["after"] > facts["before"] + 0.2, facts

    # The correct verdict: `requires_grad = False` set as a module attribute, its
    # parameters still trainable (PROTOCOL: freeze_flag_ignored, on the module).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="freeze_flag_ignored",
            causes=("freeze_flag_ignored",),
            covers=("bert.embeddings",),
        ),
    )


def freeze_bert(model: nn.Module) -> None:
    # The maintainer's answer: freeze the pretrained part, train the classifier.
    for param in model.bert.parameters():
        param.requires_grad = False


@pytest.mark.parametrize("seed", SEEDS)
def test_bert_frozen_to_train_the_classifier_alone(gradflow_server, gradflow_env, seed):
    """https://github.com/huggingface/transformers/issues/400"""
    outcome = train_bert_classifier(gradflow_env, seed, freeze_bert, lr=1e-2)

    # BERT stayed as it was; the classifier on its features learned the task.
    facts = outcome.facts
    assert not facts["embeddings_moved"] and not facts["encoder_moved"], facts
    assert facts["after"] > facts["before"] + 0.1, facts

    # Healthy: a frozen encoder is the user's choice (the optimizer holds the frozen
    # parameters, which never get a gradient).
    assert_silent(gradflow_server, outcome)

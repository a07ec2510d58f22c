"""Failures of the ninth set in a loop's schedule and modes: a warm-up linear schedule
sized for fewer steps than the loop runs, a cosine schedule stepped on every
micro-batch of a gradient accumulation, and an evaluator that leaves the model in eval
mode when it runs in the middle of an epoch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, moved, snapshot, watch

pytestmark = pytest.mark.validation


# -- wenyu332/daguan_bert_ner#12: training beyond the schedule's t_total ------------------


class BiLSTMTagger(nn.Module):
    def __init__(self, vocab: int = 50, tags: int = 7, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True, bidirectional=True)
        self.classifier = nn.Linear(2 * dim, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.lstm(self.embed(tokens))[0])


def entity_batch(n: int, g: torch.Generator, length: int = 12):
    """BIO tags: tokens 1-18 open an entity of one of three types, the tokens after it
    continue it while they are above 30."""
    tokens = torch.randint(0, 50, (n, length), generator=g)
    tags = torch.zeros(n, length, dtype=torch.long)
    for t in range(length):
        begin = (tokens[:, t] >= 1) & (tokens[:, t] <= 18)
        kind = (tokens[:, t] - 1) // 6
        tags[:, t] = torch.where(begin, 1 + 2 * kind, tags[:, t])
        if t:
            inside = (tokens[:, t] > 30) & (tags[:, t - 1] > 0)
            prev_kind = (tags[:, t - 1] - 1) // 2
            tags[:, t] = torch.where(inside, 2 + 2 * prev_kind, tags[:, t])
    return tokens, tags


def train_ner(run_id: str, seed: int, epochs: int = 3, per_epoch: int = 100) -> Outcome:
    """`num_train_optimization_steps` is computed for two epochs and the loop runs
    three: the BERT optimizer's `warmup_linear` (warm-up 10 % of t_total) reaches 0 at
    t_total and holds it there ("Learning rate multiplier set to 0.0"). Adam 1e-3 with
    the same multiplier as a `LambdaLR`, batches of 16."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9500 + seed)
    model = BiLSTMTagger()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    t_total = 2 * per_epoch
    warmup = 0.1 * t_total

    def warmup_linear(step: int) -> float:
        if step < warmup:
            return step / warmup
        return max(0.0, (t_total - step) / (t_total - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear)
    run = watch(run_id, model, optimizer)
    lrs, at_t_total = [], None
    for epoch in range(epochs):
        for i in range(per_epoch):
            tokens, tags = entity_batch(16, g)
            loss = F.cross_entropy(model(tokens).reshape(-1, 7), tags.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            run.step(loss)
            if epoch * per_epoch + i + 1 == t_total:
                at_t_total = snapshot(model)
    run.close()
    return Outcome({"model": run}, {"lrs": lrs, "moved_after": moved(at_t_total, model)})


@pytest.mark.parametrize("seed", SEEDS)
def test_ner_schedule_sized_for_fewer_steps_than_the_loop(gradflow_server, gradflow_env, seed):
    """https://github.com/wenyu332/daguan_bert_ner/issues/12"""
    outcome = train_ner(gradflow_env, seed)

    # The whole last epoch runs at lr 0 and no weight changes in it.
    facts = outcome.facts
    assert max(facts["lrs"][:200]) > 9e-4 and set(facts["lrs"][200:]) == {0.0}
    assert not facts["moved_after"], facts["moved_after"]

    # Every group's lr is exactly 0 after having been above it: a schedule built for
    # fewer steps than the loop runs.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="lr_vanished", causes=("lr_zero",)),
    )


# -- huggingface/accelerate#963: the scheduler steps on every micro-batch ----------------


class KeywordNet(nn.Module):
    """A small 1-d CNN keyword spotter on raw waveforms (batch norm, global pooling)."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, 16, 9, stride=4),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Conv1d(16, 32, 9, stride=4),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def keyword_batch(n: int, g: torch.Generator, samples: int = 400):
    """Each keyword is a pair of tones; random phase, gain and noise."""
    label = torch.randint(0, 4, (n,), generator=g)
    freqs = torch.tensor([[3.0, 11.0], [5.0, 17.0], [7.0, 13.0], [9.0, 19.0]])[label]
    t = torch.linspace(0, 1, samples)
    phase = torch.rand(n, 2, 1, generator=g) * 6.28
    wave = torch.sin(2 * math.pi * freqs[..., None] * t + phase).sum(1)
    gain = torch.rand(n, 1, generator=g) + 0.5
    x = gain * wave + 0.5 * torch.randn(n, samples, generator=g)
    return x[:, None], label


def cosine_with_warmup(warmup: int, total: int, cycles: float = 0.5):
    """`transformers.get_cosine_schedule_with_warmup`'s multiplier."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))

    return factor


def train_accumulated_keywords(run_id: str, seed: int, steps: int = 300, k: int = 4) -> Outcome:
    """The thread's script: gradient accumulation over 4 micro-batches, a cosine
    schedule with warm-up sized in optimizer steps (30 of 300), and `scheduler.step()`
    on every micro-batch beside `optimizer.step()` (which under accelerate only steps
    at the end of an accumulation). AdamW 1e-3, micro-batches of 8."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9600 + seed)
    model = KeywordNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(30, steps))
    run = watch(run_id, model, optimizer)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            for i in range(k):
                x, label = keyword_batch(8, g)
                loss = F.cross_entropy(model(x), label) / k
                loss.backward()
                if i == k - 1:
                    optimizer.step()
                    optimizer.zero_grad()
                scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
            run.step(loss * k)
    run.close()
    return Outcome({"model": run}, {"lrs": lrs, "scheduler_steps": scheduler.last_epoch})


@pytest.mark.parametrize("seed", SEEDS)
def test_accelerate_scheduler_steps_every_micro_batch(gradflow_server, gradflow_env, seed):
    """https://github.com/huggingface/accelerate/issues/963"""
    outcome = train_accumulated_keywords(gradflow_env, seed)

    # The schedule advanced four steps an optimizer step: its warm-up ended after 8
    # updates and its whole cosine was spent by the 75th, where it starts over.
    facts = outcome.facts
    assert facts["scheduler_steps"] == 4 * 300
    assert min(facts["lrs"][60:80]) < 1e-5 and max(facts["lrs"][6:10]) > 9e-4, facts["lrs"][:80]

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="scheduler_per_micro_batch",
            causes=("scheduler_per_micro_batch",),
            covers=("LambdaLR",),
        ),
    )


# -- pfnet/pytorch-pfn-extras#688: an evaluator in mid-epoch leaves eval mode ------------


class DigitNet(nn.Module):
    """The MNIST network of the pytorch-pfn-extras examples at small size: two
    convolutions (here with batch norm), dropout, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 9, 32)
        self.fc2 = nn.Linear(32, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        return self.fc2(self.dropout(F.relu(self.fc1(h.flatten(1)))))


def digit_batch(n: int, g: torch.Generator):
    label = torch.randint(0, 6, (n,), generator=g)
    templates = torch.Generator().manual_seed(88)
    pattern = torch.randn(6, 1, 12, 12, generator=templates)
    return pattern[label] + 1.0 * torch.randn(n, 1, 12, 12, generator=g), label


def train_ppe(run_id: str, seed: int, epochs: int = 3, per_epoch: int = 100) -> Outcome:
    """The manager calls `model.train()` at the start of each epoch
    (`train_epoch_begin`); the `Evaluator` extension, triggered every 50 iterations (half
    an epoch), calls `model.eval()` (`train_validation_begin`) and nothing restores
    it: the second half of every epoch trains in eval mode. SGD 0.01 momentum 0.5 as
    the examples, batches of 32."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9700 + seed)
    model = DigitNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    run = watch(run_id, model, optimizer)
    modes = []
    for _ in range(epochs):
        model.train()
        for i in range(per_epoch):
            x, label = digit_batch(32, g)
            loss = F.cross_entropy(model(x), label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            modes.append(model.training)
            run.step(loss)
            if (i + 1) % 50 == 0:
                model.eval()
                with torch.no_grad():
                    model(digit_batch(64, g)[0])
    run.close()
    return Outcome({"model": run}, {"modes": modes})


@pytest.mark.parametrize("seed", SEEDS)
def test_ppe_evaluator_leaves_the_model_in_eval_mode(gradflow_server, gradflow_env, seed):
    """https://github.com/pfnet/pytorch-pfn-extras/issues/688"""
    outcome = train_ppe(gradflow_env, seed)

    # Half the optimizer steps ran with batch norm and dropout in eval mode, in
    # stretches of 50.
    modes = outcome.facts["modes"]
    assert modes.count(False) == 150 and not any(modes[50:100]) and all(modes[100:150])

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="model_in_eval_mode", causes=("left_in_eval",)),
    )

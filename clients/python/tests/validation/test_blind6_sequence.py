"""Sequence and graph cases of the sixth set: the char-RNN tutorial's optimizer bound to
a first instance of the model, RE-Net's attention aggregator that never reaches its
attention layer, a policy's LR schedule stepped on every micro-batch of a gradient
accumulation, and a trajectory forecaster whose loss stalls before it drops.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, snapshot, watch

pytestmark = pytest.mark.validation


# -- spro/practical-pytorch#9: the optimizer holds the first instance of the model -----


class CharRNN(nn.Module):
    """The tutorial's RNN: `i2h` and `i2o` over the input and the hidden state, then
    LogSoftmax."""

    def __init__(self, letters: int, hidden: int, categories: int) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.i2h = nn.Linear(letters + hidden, hidden)
        self.i2o = nn.Linear(letters + hidden, categories)

    def forward(self, letter: torch.Tensor, hidden: torch.Tensor):
        combined = torch.cat([letter, hidden], 1)
        return F.log_softmax(self.i2o(combined), 1), self.i2h(combined)


def name_of(category: int, g: torch.Generator, letters: int = 20) -> torch.Tensor:
    """A 'name' of 4 to 8 letters; each language favours its own third of the
    alphabet."""
    length = int(torch.randint(4, 9, (1,), generator=g))
    favoured = torch.randint(0, 7, (length,), generator=g) + 6 * category
    uniform = torch.randint(0, letters, (length,), generator=g)
    pick = torch.rand(length, generator=g) < 0.7
    return F.one_hot(torch.where(pick, favoured, uniform), letters).float().unsqueeze(1)


def train_char_rnn(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The notebook with `optimizer.step()` in place of the manual update: the model is
    built once after its class (where the optimizer is made, SGD lr 0.005) and again
    before the training loop; `train()` calls `rnn.zero_grad()`, runs the name letter
    by letter, `NLLLoss`, `backward`, `optimizer.step()`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9200 + seed)
    rnn = CharRNN(20, 64, 3)
    optimizer = torch.optim.SGD(rnn.parameters(), lr=0.005)
    rnn = CharRNN(20, 64, 3)
    run = watch(run_id, rnn, optimizer)
    before = snapshot(rnn)
    grads = []
    for _ in range(steps):
        category = int(torch.randint(0, 3, (1,), generator=g))
        line = name_of(category, g)
        rnn.zero_grad()
        hidden = torch.zeros(1, rnn.hidden_size)
        for i in range(line.shape[0]):
            output, hidden = rnn(line[i], hidden)
        loss = F.nll_loss(output, torch.tensor([category]))
        loss.backward()
        grads.append(rnn.i2o.weight.grad.abs().sum().item())
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "moved": sorted(n for n, p in rnn.named_parameters() if not torch.equal(p, before[n])),
            "grad_share": mean([float(v > 0) for v in grads]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_char_rnn_optimizer_holds_the_first_instance(gradflow_server, gradflow_env, seed):
    """https://github.com/spro/practical-pytorch/issues/9"""
    outcome = train_char_rnn(gradflow_env, seed)

    # The trained model gets a gradient on every step and none of its weights moves.
    facts = outcome.facts
    assert facts["moved"] == [], facts
    assert facts["grad_share"] == 1.0, facts

    # The correct verdict: the optimizer holds none of the model's parameters.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model", kind="nothing_trains", causes=("none_in_optimizer",), covers=("run",)
        ),
    )


# -- INK-USC/RE-Net#6: the attention aggregator returns zeros ---------------------------


class AttnAggregator(nn.Module):
    """RE-Net's aggregator as in the thread: it owns the attention layer `attn_s`, but
    its `forward` fills the history tensor with zeros, passes them through dropout and
    packs them; `attn_s` is never applied."""

    def __init__(self, h_dim: int, seq_len: int) -> None:
        super().__init__()
        self.h_dim = h_dim
        self.seq_len = seq_len
        self.attn_s = nn.Linear(3 * h_dim, h_dim)
        self.dropout = nn.Dropout(0.2)

    def forward(self, s_len: torch.Tensor) -> torch.Tensor:
        s_embed_seq_tensor = torch.zeros(len(s_len), self.seq_len, 3 * self.h_dim)
        s_embed_seq_tensor = self.dropout(s_embed_seq_tensor)
        return nn.utils.rnn.pack_padded_sequence(
            s_embed_seq_tensor, s_len, batch_first=True, enforce_sorted=False
        )


class RENet(nn.Module):
    """Entity and relation embeddings, the aggregator, a GRU encoder over the history,
    and a linear layer scoring every object entity from (s, r, h)."""

    def __init__(self, entities: int = 40, relations: int = 5, h_dim: int = 16) -> None:
        super().__init__()
        self.ent_embeds = nn.Embedding(entities, h_dim)
        self.rel_embeds = nn.Embedding(relations, h_dim)
        self.aggregator = AttnAggregator(h_dim, seq_len=5)
        self.encoder = nn.GRU(3 * h_dim, h_dim, batch_first=True)
        self.linear_sub = nn.Linear(3 * h_dim, entities)

    def forward(self, s: torch.Tensor, r: torch.Tensor, s_len: torch.Tensor) -> torch.Tensor:
        packed = self.aggregator(s_len)
        _, h = self.encoder(packed)
        feats = torch.cat([self.ent_embeds(s), self.rel_embeds(r), h.squeeze(0)], 1)
        return self.linear_sub(feats)


def train_renet(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Object prediction on synthetic quadruples (the object is a fixed function of
    subject and relation); cross entropy, Adam lr 1e-3 and a gradient-norm clip at
    1.0."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9300 + seed)
    model = RENet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    losses = []
    for _ in range(steps):
        s = torch.randint(0, 40, (64,), generator=g)
        r = torch.randint(0, 5, (64,), generator=g)
        o = (s * 3 + r * 7) % 40
        s_len = torch.randint(1, 6, (64,), generator=g)
        loss = F.cross_entropy(model(s, r, s_len), o)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    now = dict(model.named_parameters())
    return Outcome(
        {"model": run},
        {
            "attn_unchanged": all(
                torch.equal(now[n].detach(), before[n]) for n in before if "attn_s" in n
            ),
            "attn_grad": model.aggregator.attn_s.weight.grad,
            "first": mean(losses[:20]),
            "last": mean(losses[-20:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_renet_attention_layer_never_applied(gradflow_server, gradflow_env, seed):
    """https://github.com/INK-USC/RE-Net/issues/6"""
    outcome = train_renet(gradflow_env, seed)

    # `attn_s` never gets a gradient and never changes; the embeddings and the scorer
    # learn.
    facts = outcome.facts
    assert facts["attn_unchanged"] and facts["attn_grad"] is None, facts
    assert facts["last"] < 0.85 * facts["first"], facts

    # The correct verdict: the attention layer is never reached by backward.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="grad_stuck_zero",
            causes=("backward_not_reached", "grad_missing"),
            covers=("aggregator.attn_s",),
        ),
    )


# -- starVLA/starVLA#210: the LR schedule stepped on every micro-batch -----------------


def cosine_with_warmup(warmup: int, total: int):
    """transformers' `get_cosine_schedule_with_warmup` as a `LambdaLR` factor."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


def train_starvla(run_id: str, seed: int, steps: int = 300, accumulation: int = 2) -> Outcome:
    """A vision-language-action policy's action head regressing actions from
    observation features: AdamW lr 1e-3, a cosine schedule with 20 warm-up steps sized
    for the 300 optimizer steps, gradient accumulation 2; the trainer calls
    `lr_scheduler.step()` on every micro-batch while the optimizer steps on every
    second one."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9400 + seed)
    policy = nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 7)
    )
    target = nn.Linear(32, 7)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(20, steps))
    run = watch(run_id, policy, optimizer)
    held = torch.randn(1024, 32, generator=g)
    with torch.no_grad():
        held_actions = torch.tanh(target(held))
        before = F.mse_loss(policy(held), held_actions).item()
    lrs = []
    for micro in range(steps * accumulation):
        obs = torch.randn(32, 32, generator=g)
        with torch.no_grad():
            actions = torch.tanh(target(obs))
        loss = F.mse_loss(policy(obs), actions) / accumulation
        loss.backward()
        if (micro + 1) % accumulation == 0:
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            optimizer.zero_grad()
            run.step(loss * accumulation)
        scheduler.step()
    run.close()
    with torch.no_grad():
        after = F.mse_loss(policy(held), held_actions).item()
    return Outcome(
        {"model": run},
        {
            "scheduler_steps": scheduler.last_epoch,
            "lr_at_half": lrs[steps // 2],
            "lr_at_end": lrs[-1],
            "before": before,
            "after": after,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_starvla_scheduler_stepped_every_micro_batch(gradflow_server, gradflow_env, seed):
    """https://github.com/starVLA/starVLA/pull/210"""
    outcome = train_starvla(gradflow_env, seed)

    # 300 optimizer steps, 600 scheduler steps: the cosine reaches 0 at half the run
    # and climbs back to the peak by its end.
    facts = outcome.facts
    assert outcome.runs["model"].steps == 300
    assert facts["scheduler_steps"] == 600, facts
    assert facts["lr_at_half"] < 1e-5 and facts["lr_at_end"] > 5e-4, facts

    # The correct verdict: the scheduler advances twice per optimizer step.
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


# -- ChuhuaW/SGNet.pytorch#14: the loss stalls, then drops ------------------------------


class GoalForecaster(nn.Module):
    """A GRU encoder over the observed track and a head for the goal's offset."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.encoder = nn.GRU(2, hidden, batch_first=True)
        self.goal = nn.Linear(hidden, 2)

    def forward(self, track: torch.Tensor) -> torch.Tensor:
        h, _ = self.encoder(track)
        return self.goal(h[:, -1])


def train_forecaster(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Observed tracks of 15 steps whose first step carries the turn that decides the
    goal; MSE on the goal offset, Adam lr 3e-3 (no decay in the first steps, as the
    maintainer notes)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9100 + seed)
    model = GoalForecaster()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    run = watch(run_id, model, optimizer)
    losses = []
    for _ in range(steps):
        turn = torch.randint(0, 2, (64,), generator=g).float() * 2 - 1
        track = 0.1 * torch.randn(64, 15, 2, generator=g)
        track[:, 0, 0] += turn
        loss = F.mse_loss(model(track), torch.stack([turn, -turn], 1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome({"model": run}, {"stalled": mean(losses[:50]), "last": mean(losses[-30:])})


@pytest.mark.parametrize("seed", SEEDS)
def test_forecaster_loss_stalls_then_drops(gradflow_server, gradflow_env, seed):
    """https://github.com/ChuhuaW/SGNet.pytorch/issues/14"""
    outcome = train_forecaster(gradflow_env, seed)

    # The loss sits at the targets' variance (1) for the first 50 steps, then falls to
    # nearly 0.
    facts = outcome.facts
    assert facts["stalled"] > 0.95, facts
    assert facts["last"] < 0.05, facts

    # The correct verdict: a healthy run.
    assert_silent(gradflow_server, outcome)

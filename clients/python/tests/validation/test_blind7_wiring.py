"""Failures of the seventh set in how a model, its loss or its schedule is wired: a
graph readout against labels of another shape, layers kept in a plain list, a learned
activation slope held in a plain tensor, a draft head's schedule sized for fewer steps
than the run, and an embedding network whose loss is never backpropagated."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, moved, snapshot, watch

pytestmark = pytest.mark.validation


# -- IntelLabs/matsciml#347: a graph readout (N,) against labels (N, 1) -----------------


class GraphNet(nn.Module):
    """Two rounds of message passing over a dense adjacency, a mean readout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 32)
        self.message = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.readout = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        for layer in self.message:
            h = torch.relu(h + adj @ layer(h) / 3)
        return self.readout(h.mean(1)).squeeze(-1)


def graphs(n: int, g: torch.Generator):
    x = torch.randn(n, 6, 4, generator=g)
    adj = (torch.rand(n, 6, 6, generator=g) < 0.4).float()
    adj = ((adj + adj.transpose(1, 2)) > 0).float()
    y = x[..., 0].sum(1) + 0.5 * (adj @ x[..., 1:2]).sum((1, 2)) / 6
    return x, adj, y.unsqueeze(-1)


def train_graph(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The graph readouts come out (N,), the labels out of the pipeline (N, 1);
    `nn.MSELoss()` broadcasts them to (N, N). Adam 1e-3, batches of 32 graphs."""
    import warnings

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7600 + seed)
    model = GraphNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.MSELoss()
    run = watch(run_id, model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            x, adj, y = graphs(32, g)
            loss = criterion(model(x, adj), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
    run.close()
    x, adj, y = graphs(1000, g)
    with torch.no_grad():
        pred = model(x, adj)
    r2 = 1 - ((pred - y[:, 0]) ** 2).mean() / y.var()
    return Outcome({"model": run}, {"r2": r2.item()})


@pytest.mark.parametrize("seed", SEEDS)
def test_matsciml_readout_broadcasts_against_the_labels(gradflow_server, gradflow_env, seed):
    """https://github.com/IntelLabs/matsciml/pull/347"""
    outcome = train_graph(gradflow_env, seed)

    # The model learns the batch mean: R² near 0 on held-out graphs.
    assert outcome.facts["r2"] < 0.1, outcome.facts

    # The expectation named no cause when the set was built, and a verdict with no
    # cause listed can never pass; PROTOCOL's table gives this kind one cause, of
    # its own name.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="loss_broadcasts", causes=("loss_broadcasts",)),
    )


# -- pytorch/pytorch#715: hidden layers kept in a plain list -----------------------------


class NLINet(nn.Module):
    """The thread's SNLI classifier: premise and hypothesis bags of words, hidden
    layers built in a loop and kept in a plain list, a 3-way classifier."""

    def __init__(self, vocab: int = 100, n_hid: int = 64, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, n_hid // 2)
        self.hids = []
        for _ in range(n_layers):
            self.hids.append([nn.Linear(n_hid, n_hid), nn.Tanh()])
        self.classifier = nn.Linear(n_hid, 3)

    def forward(self, premise, hypothesis):
        h = torch.cat([self.embed(premise), self.embed(hypothesis)], -1)
        for linear, act in self.hids:
            h = act(linear(h))
        return self.classifier(h)


def train_nli(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Adam 1e-3 over `model.parameters()`; the label is how many premise words the
    hypothesis shares (none, some, all)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7700 + seed)
    model = NLINet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    hidden = [linear.weight.detach().clone() for linear, _ in model.hids]
    before = snapshot(model)
    for _ in range(steps):
        premise = torch.randint(0, 100, (32, 4), generator=g)
        label = torch.randint(0, 3, (32,), generator=g)
        fresh = torch.randint(0, 100, (32, 4), generator=g)
        keep = torch.arange(4) < (label * 2).unsqueeze(1)
        hypothesis = torch.where(keep, premise, fresh)
        loss = F.cross_entropy(model(premise, hypothesis), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    same = all(torch.equal(w, linear.weight) for w, (linear, _) in zip(hidden, model.hids))
    return Outcome({"model": run}, {"hidden_unchanged": same, "moved": moved(before, model)})


@pytest.mark.parametrize("seed", SEEDS)
def test_nli_hidden_layers_in_a_plain_list(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/pytorch/issues/715"""
    outcome = train_nli(gradflow_env, seed)

    # The listed layers compute every forward pass and never change; the embedding
    # and the classifier train.
    assert outcome.facts["hidden_unchanged"], outcome.facts
    assert {"embed.weight", "classifier.weight"} <= outcome.facts["moved"], outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="modules_not_registered", causes=("modules_not_registered",)),
    )


# -- shenweichen/DeepCTR-Torch#93: Dice's alpha is a plain tensor ------------------------


class Dice(nn.Module):
    """DeepCTR-Torch's Dice before the fix: `self.alpha = torch.zeros((emb_size,))`."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(size, eps=1e-8)
        self.alpha = torch.zeros((size,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.bn(x))
        return self.alpha * (1 - p) * x + p * x


class CTRNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user, self.item = nn.Embedding(200, 8), nn.Embedding(300, 8)
        self.dnn = nn.Sequential(nn.Linear(16, 32), Dice(32), nn.Linear(32, 16), Dice(16))
        self.out = nn.Linear(16, 1)

    def forward(self, user, item):
        return self.out(self.dnn(torch.cat([self.user(user), self.item(item)], -1))).squeeze(-1)


def train_ctr(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A DIN-style click model with Dice activations; Adam 1e-3, BCE with logits."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7800 + seed)
    taste = torch.randn(200, 4, generator=g)
    kind = torch.randn(300, 4, generator=g)
    model = CTRNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    for _ in range(steps):
        user = torch.randint(0, 200, (128,), generator=g)
        item = torch.randint(0, 300, (128,), generator=g)
        click = ((taste[user] * kind[item]).sum(-1) > 0).float()
        loss = F.binary_cross_entropy_with_logits(model(user, item), click)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    alphas = [m.alpha for m in model.modules() if isinstance(m, Dice)]
    return Outcome({"model": run}, {"alphas_zero": all(not a.any() for a in alphas)})


@pytest.mark.parametrize("seed", SEEDS)
def test_deepctr_dice_alpha_is_not_a_parameter(gradflow_server, gradflow_env, seed):
    """https://github.com/shenweichen/DeepCTR-Torch/issues/93"""
    outcome = train_ctr(gradflow_env, seed)

    # The learned slope stays at its initial 0 in every Dice layer.
    assert outcome.facts["alphas_zero"], outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="tensors_not_registered",
            covers=("dnn",),
            causes=("tensors_not_registered",),
        ),
    )


# -- SafeAILab/EAGLE#107: the linear schedule reaches 0 long before the run ends ---------


def train_draft_head(
    run_id: str, seed: int, steps: int = 300, schedule_steps: int = 120
) -> Outcome:
    """EAGLE's draft head: the current feature and the next token's embedding in, the
    next feature out (smooth L1); AdamW 3e-5 with a linear warm-up of 20 steps and a
    linear decay to 0 at `total_steps`, set for fewer steps than the run takes (the
    transformers schedule holds the lr at 0 beyond it)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7900 + seed)
    step_map = torch.randn(32, 32, generator=g) / 6
    tokens = torch.randn(50, 32, generator=g)
    model = nn.ModuleDict(
        {"embed": nn.Embedding(50, 32), "fc": nn.Linear(64, 64), "out": nn.Linear(64, 32)}
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: s / 20 if s < 20 else max(0.0, (schedule_steps - s) / (schedule_steps - 20)),
    )
    run = watch(run_id, model, optimizer)
    late = None
    for step in range(steps):
        feature = torch.randn(64, 32, generator=g)
        token = torch.randint(0, 50, (64,), generator=g)
        target = torch.tanh(feature @ step_map + tokens[token])
        h = torch.relu(model["fc"](torch.cat([feature, model["embed"](token)], -1)))
        loss = F.smooth_l1_loss(model["out"](h), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        run.step(loss)
        if step == schedule_steps:
            late = snapshot(model)
    run.close()
    return Outcome(
        {"model": run},
        {"moved_late": moved(late, model), "lr_end": optimizer.param_groups[0]["lr"]},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_eagle_schedule_ends_before_the_run(gradflow_server, gradflow_env, seed):
    """https://github.com/SafeAILab/EAGLE/pull/107"""
    outcome = train_draft_head(gradflow_env, seed)

    # From step 120 the lr is 0: no weight changes over the last 180 steps.
    assert outcome.facts["lr_end"] == 0.0 and not outcome.facts["moved_late"], outcome.facts

    assert_caught(
        gradflow_server, outcome, Diagnosis(run="model", kind="lr_vanished", causes=("lr_zero",))
    )


# -- YHL04/memeagent#3: the episodic novelty module steps without a backward -------------


def train_novelty(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """NGU's episodic novelty: an embedding network trained by inverse dynamics (the
    action from the embeddings of two successive states, cross-entropy), Adam 5e-4.
    `self.opt.zero_grad()`, the loss, `loss.mean()`, `self.opt.step()`: no
    `loss.backward()`."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(8000 + seed)
    moves = torch.randn(4, 16, generator=g)
    embed = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
    inverse = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    model = nn.ModuleDict({"embedding": embed, "inverse": inverse})
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    run = watch(run_id, model, opt)
    before = snapshot(model)
    for _ in range(steps):
        s = torch.randn(64, 16, generator=g)
        a = torch.randint(0, 4, (64,), generator=g)
        s2 = s + moves[a]
        opt.zero_grad()
        loss = F.cross_entropy(inverse(torch.cat([embed(s), embed(s2)], -1)), a, reduction="none")
        loss = loss.mean()
        opt.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"moved": moved(before, model)})


@pytest.mark.parametrize("seed", SEEDS)
def test_novelty_module_steps_without_backward(gradflow_server, gradflow_env, seed):
    """https://github.com/YHL04/memeagent/issues/3"""
    outcome = train_novelty(gradflow_env, seed)

    # No parameter ever changes.
    assert not outcome.facts["moved"], outcome.facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model", kind="grad_stuck_zero", causes=("backward_not_reached", "grad_missing")
        ),
    )

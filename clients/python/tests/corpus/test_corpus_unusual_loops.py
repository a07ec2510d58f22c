"""Corpus: healthy runs whose loops or losses look wrong and are not: BYOL, whose
loss is negative and whose target network moves by hand under `no_grad`; REINFORCE
with a backward pass per time step and one optimizer step per episode; and a
recurrent model evaluated with `model.eval()` and never put back in training mode,
which changes nothing in a model without dropout or batch norm.

Each runs at three seeds for 400 steps: three times `loss_spike`'s window of 128
readings, the longest of the loss rules involved.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from corpus_support import Progress, expects_silence, judge, quickstart
from torch import nn

# Every case here is a healthy run (the corpus table counts them as look-alikes).
SEEDS = [0, 1, 2]
STEPS = 400


# -- BYOL: a negative loss and a target network moved by hand ------------------------


# The augmentation: views are the points plus noise of this scale.
NOISE = 0.5


def mlp(width: int, out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, out))


class Online(nn.Module):
    """BYOL's online network: encoder, projector and predictor."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = mlp(32, 32)
        self.projector = mlp(32, 16)
        self.predictor = mlp(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.projector(self.encoder(x)))


def view(points: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A noisy view of each point (the augmentation)."""
    return points + NOISE * torch.randn(points.shape, generator=g)


def retrieval(encoder: nn.Module, points: torch.Tensor, g: torch.Generator) -> float:
    """How often a noisy view's nearest neighbour among other views of every point is
    its own point's."""
    encoder.eval()
    with torch.no_grad():
        a = nn.functional.normalize(encoder(view(points, g)))
        b = nn.functional.normalize(encoder(view(points, g)))
    encoder.train()
    return float(((a @ b.T).argmax(1) == torch.arange(len(points))).float().mean())


@expects_silence
@pytest.mark.parametrize("seed", SEEDS)
def test_byol_whose_loss_is_negative_and_whose_target_moves_by_hand(
    request, gradflow_server, gradflow_env, seed
):
    """BYOL as Lightning Bolts writes it: the target network runs under
    `torch.no_grad()` (the question was whether a `.detach()` is missing: it is not),
    the loss is `-2 * cosine_similarity` per view pair, negative from the first steps,
    and the target follows the online network by an exponential moving average
    (τ 0.99) after each optimizer step.

    Thread: https://github.com/Lightning-Universe/lightning-bolts/issues/801
    """
    torch.manual_seed(seed)
    online = Online()
    target = Online()
    target.load_state_dict(online.state_dict())
    target.requires_grad_(False)
    optimizer = torch.optim.Adam(online.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + seed)
    points = torch.randn(128, 32, generator=g)
    start = retrieval(online.encoder, points, torch.Generator().manual_seed(7))
    losses: List[float] = []

    def step(i: int) -> torch.Tensor:
        batch = points[torch.randint(0, len(points), (32,), generator=g)]
        view_1 = view(batch, g)
        view_2 = view(batch, g)
        with torch.no_grad():
            z_1 = target.projector(target.encoder(view_1))
            z_2 = target.projector(target.encoder(view_2))
        loss = -2 * nn.functional.cosine_similarity(online(view_1), z_2).mean()
        loss = loss - 2 * nn.functional.cosine_similarity(online(view_2), z_1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for t, o in zip(target.parameters(), online.parameters()):
                t.mul_(0.99).add_(o, alpha=0.01)
        losses.append(loss.item())
        return loss

    run_id = quickstart(online, optimizer, step, steps=STEPS)
    assert max(losses[10:]) < 0, max(losses[10:])  # negative from the first steps on
    end = retrieval(online.encoder, points, torch.Generator().manual_seed(7))
    # A quarter of the misses gone.
    fewer = Progress("retrieval misses of noisy views", 1 - start, 1 - end, by=0.25)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=fewer)


# -- REINFORCE: a backward pass per time step, one step per episode ------------------

# A two-armed choice repeated over an episode of `HORIZON` steps: the state says which
# arm pays (reward 1), the other pays 0.
HORIZON = 8


@expects_silence
@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_with_a_backward_per_time_step(request, gradflow_server, gradflow_env, seed):
    """Hands-on RL's REINFORCE update: `zero_grad()` once, then walking the episode
    backwards each time step's `-log π(a|s) G` is backpropagated on its own, and one
    `optimizer.step()` takes the sum ("why is optimizer.step outside the loop and
    loss.backward inside?"). A loop with eight backward passes per step, every one
    of them wanted.

    Thread: https://github.com/boyu-ai/Hands-on-RL/issues/7
    """
    torch.manual_seed(seed)
    policy = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 2))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + seed)
    returns: List[float] = []

    def episode(i: int) -> torch.Tensor:
        states = torch.randn(HORIZON, 4, generator=g)
        pays = (states[:, 0] > 0).long()
        probs = torch.softmax(policy(states), 1)
        actions = torch.multinomial(probs.detach(), 1, generator=g).squeeze(1)
        rewards = (actions == pays).float()
        returns.append(float(rewards.sum()))
        optimizer.zero_grad()
        total = torch.zeros(())
        ret = 0.0
        for t in reversed(range(HORIZON)):
            ret = 0.98 * ret + float(rewards[t])
            log_prob = torch.log(torch.softmax(policy(states[t : t + 1]), 1)[0, actions[t]])
            loss = -log_prob * ret
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total

    held_out = torch.randn(512, 4, generator=torch.Generator().manual_seed(999))

    def right_arm() -> float:
        """The policy's mean probability of the arm that pays, on held-out states."""
        with torch.no_grad():
            probs = torch.softmax(policy(held_out), 1)
        return float(probs.gather(1, (held_out[:, :1] > 0).long()).mean())

    start = right_arm()
    run_id = quickstart(policy, optimizer, episode, steps=STEPS)
    assert sum(returns[-100:]) > sum(returns[:100]), returns
    learned = Progress(
        "probability of the arm that pays", start, right_arm(), by=0.15 / start, higher=True
    )
    judge(request, gradflow_server, run_id, steps=STEPS, progress=learned)


# -- a recurrent model left in eval mode, which changes nothing ----------------------


class CoRNN(nn.Module):
    """A coupled oscillatory RNN (no dropout, no batch norm): its outputs are the same
    in training and in eval mode."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.i2h = nn.Linear(2 + 2 * hidden, hidden)
        self.readout = nn.Linear(hidden, 1)
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(x.shape[1], self.hidden)
        z = torch.zeros(x.shape[1], self.hidden)
        for step in x:
            z = z + 0.05 * (torch.tanh(self.i2h(torch.cat([step, z, y], 1))) - 4.0 * y - 1.0 * z)
            y = y + 0.05 * z
        return self.readout(y)


def adding_batch(g: torch.Generator, n: int = 16, length: int = 20) -> tuple:
    """The adding problem: random values, two of them marked; the target is their sum."""
    values = torch.rand(length, n, generator=g)
    marks = torch.zeros(length, n)
    for b in range(n):
        first, second = torch.randperm(length, generator=g)[:2]
        marks[first, b] = marks[second, b] = 1.0
    return torch.stack([values, marks], 2), (values * marks).sum(0, keepdim=True).T


@expects_silence
@pytest.mark.parametrize("seed", SEEDS)
def test_a_recurrent_model_left_in_eval_mode_without_dropout(
    request, gradflow_server, gradflow_env, seed
):
    """The coRNN adding task calls `model.eval()` to test every 100 steps and never
    `model.train()` again; the authors: "this does not affect the outcome of the
    model, as model.eval() and model.train() changes the model behavior only if
    something like dropout or BatchNorm is used". The model learns the task.

    Thread: https://github.com/tk-rusch/coRNN/issues/1
    """
    torch.manual_seed(seed)
    model = CoRNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(100 + seed)
    test_x, test_y = adding_batch(torch.Generator().manual_seed(999), n=256)

    def test_error() -> float:
        model.eval()
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(test_x), test_y))

    start = test_error()
    model.train()

    def step(i: int) -> torch.Tensor:
        x, y = adding_batch(g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 100 == 99:
            test_error()  # the loop's evaluation, never followed by model.train()
        return loss

    run_id = quickstart(model, optimizer, step, steps=STEPS)
    assert not model.training
    fitted = Progress("error on held-out sums", start, test_error(), by=0.5)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=fitted)
    # Said as what is known: no module of PyTorch's in the model reads the mode.
    told = [a for a in gradflow_server.alerts(run_id) if a["kind"] == "model_in_eval_mode"]
    assert [(a["severity"], a["evidence"]["mode_dependent_modules"]) for a in told] == [
        ("info", 0)
    ], told

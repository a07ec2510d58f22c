"""Reinforcement learning (the fourth set): Hands-on-RL's actor-critic on CartPole,
regrouped so that the actor's update lost its `zero_grad`, and Coach's dueling double
DQN, whose loss climbs while the agent learns.

The actor and the critic each have an optimizer of their own and are watched as two
runs. CartPole is the first set's copy of gym's CartPole-v0; the corridor is the
second set's.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Deque, List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, watch
from .test_holdout_rl import STATES, Chain, one_hot
from .test_validation_rl import CartPole

pytestmark = pytest.mark.validation


class PolicyNet(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class ValueNet(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def train_regrouped_actor_critic(run_id: str, seed: int, episodes: int = 300) -> Outcome:
    """The book's chapter 10 `ActorCritic` (actor lr 1e-3, critic lr 1e-2, gamma
    0.98, one update per episode on the whole episode) with `update` regrouped as
    the thread shows: the critic's zero_grad, backward and step first, then the TD
    error from the updated critic, `actor_loss.backward()` and
    `actor_optimizer.step()`, with no `actor_optimizer.zero_grad()` left."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5200 + seed)
    env = CartPole(g)
    actor, critic = PolicyNet(), ValueNet()
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=1e-3)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=1e-2)
    runs = {
        "actor": watch(f"{run_id}-actor", actor, actor_optimizer),
        "critic": watch(f"{run_id}-critic", critic, critic_optimizer),
    }
    gamma = 0.98
    grad_norms: List[float] = []
    last = {}
    for _ in range(episodes):
        state, done = env.reset(), False
        states, actions, rewards, next_states, dones = [], [], [], [], []
        while not done:
            with torch.no_grad():
                probs = actor(torch.tensor([state]))
            action = int(torch.multinomial(probs[0], 1, generator=g))
            next_state, reward, done = env.step(action)
            states.append(state)
            actions.append(action)
            rewards.append(reward)
            next_states.append(next_state)
            dones.append(float(done))
            state = next_state
        s = torch.tensor(states)
        a = torch.tensor(actions).view(-1, 1)
        r = torch.tensor(rewards).view(-1, 1)
        s2 = torch.tensor(next_states)
        d = torch.tensor(dones).view(-1, 1)

        # The critic, updated first.
        td_target = r + gamma * critic(s2) * (1 - d)
        critic_loss = torch.mean(F.mse_loss(critic(s), td_target.detach()))
        critic_optimizer.zero_grad()
        critic_loss.backward()
        critic_optimizer.step()
        runs["critic"].step(critic_loss)

        # The actor, from the updated critic: no zero_grad.
        td_delta = td_target - critic(s)
        log_probs = torch.log(actor(s).gather(1, a))
        actor_loss = torch.mean(-log_probs * td_delta.detach())
        actor_loss.backward()
        actor_optimizer.step()
        runs["actor"].step(actor_loss)
        grad_norms.append(actor.fc1.weight.grad.norm().item())
        last = {"s": s, "a": a, "td_delta": td_delta.detach()}
    for run in runs.values():
        run.close()

    # The actor's own gradient on the last episode, for comparison.
    stale = actor.fc1.weight.grad.norm().item()
    actor.zero_grad()
    torch.mean(-torch.log(actor(last["s"]).gather(1, last["a"])) * last["td_delta"]).backward()
    return Outcome(
        runs,
        {
            "stale_norm": stale,
            "fresh_norm": actor.fc1.weight.grad.norm().item(),
            "early_norm": mean(grad_norms[:10]),
            "late_norm": mean(grad_norms[-10:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_actor_critic_regrouped_without_actor_zero_grad(gradflow_server, gradflow_env, seed):
    """https://github.com/boyu-ai/Hands-on-RL/issues/92"""
    outcome = train_regrouped_actor_critic(gradflow_env, seed)

    # The actor's last step used the pile of every episode's gradient, far larger
    # than the episode's own, and growing over the run.
    facts = outcome.facts
    assert facts["stale_norm"] > 5 * facts["fresh_norm"], facts
    assert facts["late_norm"] > 3 * facts["early_norm"], facts

    # The correct verdict: on the actor's run, gradients carried over from step to
    # step (PROTOCOL: grads_not_zeroed, cause not_zeroed); the critic is healthy.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="actor", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )


# -- IntelLabs/coach#214: the dueling double DQN's loss climbs as it learns -----------


class DuelingQ(nn.Module):
    """Coach's dueling head: a shared layer, a state value and action advantages,
    combined as V + A - mean(A)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(STATES, hidden), nn.ReLU())
        self.value = nn.Linear(hidden, 1)
        self.advantage = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        advantage = self.advantage(h)
        return self.value(h) + advantage - advantage.mean(1, keepdim=True)


def corridor_return(network: nn.Module) -> float:
    env, total = Chain(), 0.0
    state, done = env.reset(), False
    while not done:
        with torch.no_grad():
            action = network(one_hot(torch.tensor([state]))).argmax(1).item()
        state, reward, done = env.step(action)
        total += reward
    return total


# The optimal value of moving right from the corridor's first cell: three moves at
# -0.01, then the reward 1, discounted by 0.99 a move.
Q_STAR_START = -0.01 * (1 + 0.99 + 0.99**2) + 0.99**3


def start_value_error(network: nn.Module) -> float:
    with torch.no_grad():
        return abs(network(one_hot(torch.tensor([0])))[0, 1].item() - Q_STAR_START)


def train_dueling_ddqn(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Coach's Dueling DDQN preset in small: an online and a separate target network
    (copied every 20 steps, never in the optimizer), the double-DQN target (the
    online network picks the next action, the target network values it), MSE loss,
    Adam (lr 3e-3, scaled up from 2.5e-4 for a 300-step run), epsilon from 1 to 0.05
    over the first half, one step per environment step after 50 of warm-up."""
    torch.manual_seed(seed)
    rng = random.Random(5400 + seed)
    online, target = DuelingQ(), DuelingQ()
    target.load_state_dict(online.state_dict())
    optimizer = torch.optim.Adam(online.parameters(), lr=3e-3)
    run = watch(run_id, online, optimizer)
    buffer: Deque[Tuple[int, int, float, int, bool]] = deque(maxlen=10_000)
    env = Chain()
    state = env.reset()
    error_before = start_value_error(online)
    losses: List[float] = []
    warmup = 50
    for t in range(warmup + steps):
        epsilon = max(0.05, 1 - t / ((warmup + steps) * 0.5))
        if rng.random() < epsilon:
            action = rng.randrange(2)
        else:
            with torch.no_grad():
                action = online(one_hot(torch.tensor([state]))).argmax(1).item()
        nxt, reward, done = env.step(action)
        buffer.append((state, action, reward, nxt, done))
        state = env.reset() if done else nxt
        if t < warmup:
            continue
        batch = rng.sample(list(buffer), min(32, len(buffer)))
        s, a, r, s2, d = (torch.tensor(x) for x in zip(*batch))
        with torch.no_grad():
            next_action = online(one_hot(s2)).argmax(1, keepdim=True)
            next_q = target(one_hot(s2)).gather(1, next_action).squeeze(1)
            goal = r.float() + (1 - d.float()) * 0.99 * next_q
        current = online(one_hot(s)).gather(1, a.unsqueeze(1)).squeeze(1)
        loss = F.mse_loss(current, goal)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
        if (t - warmup) % 20 == 19:
            target.load_state_dict(online.state_dict())
    run.close()
    return Outcome(
        {"model": run},
        {
            "error_before": error_before,
            "error_after": start_value_error(online),
            "return_after": corridor_return(online),
            "loss_first": mean(losses[:30]),
            "loss_peak": max(mean(losses[i : i + 30]) for i in range(0, len(losses) - 30, 10)),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_dueling_ddqn_loss_climbs_while_the_agent_learns(gradflow_server, gradflow_env, seed):
    """https://github.com/IntelLabs/coach/issues/214"""
    outcome = train_dueling_ddqn(gradflow_env, seed)

    # The TD loss climbed well above where it started (the targets move as the
    # values grow); the start's value came close to the optimal one and the greedy
    # agent walks the corridor to its reward.
    facts = outcome.facts
    assert facts["loss_peak"] > 1.5 * facts["loss_first"], facts
    assert facts["error_after"] < 0.3 * facts["error_before"], facts
    assert facts["return_after"] > 0.9, facts

    # The correct verdict: a healthy value-based agent.
    assert_silent(gradflow_server, outcome)

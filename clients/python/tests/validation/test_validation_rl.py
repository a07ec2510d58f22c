"""Reinforcement learning: PPO whose gradients are clipped to a norm of 0, and a
healthy REINFORCE whose loss grows with the return as the policy learns.

The environments are written out here (no gym): CartPole with the classic control
equations and CartPole-v0's 200-step limit, and a point that must reach a target.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.distributions import Normal

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

pytestmark = pytest.mark.validation


# -- environments ----------------------------------------------------------------------


class CartPole:
    """gym's CartPole: push the cart left or right to keep the pole up; reward 1 a
    step; the episode ends when the pole tilts past 12 degrees, the cart leaves the
    track, or after 200 steps (CartPole-v0)."""

    GRAVITY, CART_MASS, POLE_MASS, HALF_LENGTH = 9.8, 1.0, 0.1, 0.5
    FORCE, TAU, LIMIT = 10.0, 0.02, 200
    THETA_MAX, X_MAX = 12 * 2 * math.pi / 360, 2.4

    def __init__(self, g: torch.Generator) -> None:
        self.g = g
        self.state: List[float] = []
        self.t = 0

    def reset(self) -> List[float]:
        self.state = ((torch.rand(4, generator=self.g) - 0.5) * 0.1).tolist()
        self.t = 0
        return self.state

    def step(self, action: int) -> Tuple[List[float], float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = self.FORCE if action == 1 else -self.FORCE
        total = self.CART_MASS + self.POLE_MASS
        pole_ml = self.POLE_MASS * self.HALF_LENGTH
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + pole_ml * theta_dot**2 * sin) / total
        theta_acc = (self.GRAVITY * sin - cos * temp) / (
            self.HALF_LENGTH * (4.0 / 3.0 - self.POLE_MASS * cos**2 / total)
        )
        x_acc = temp - pole_ml * theta_acc * cos / total
        x, x_dot = x + self.TAU * x_dot, x_dot + self.TAU * x_acc
        theta, theta_dot = theta + self.TAU * theta_dot, theta_dot + self.TAU * theta_acc
        self.state = [x, x_dot, theta, theta_dot]
        self.t += 1
        fallen = abs(x) > self.X_MAX or abs(theta) > self.THETA_MAX
        return self.state, 1.0, fallen or self.t >= self.LIMIT


class Reach:
    """A point on a plane moved by a velocity action toward a target; reward: minus
    the distance; 32 steps an episode. Observation: position and target."""

    LENGTH = 32

    def __init__(self, g: torch.Generator) -> None:
        self.g = g
        self.pos = torch.zeros(2)
        self.target = torch.zeros(2)
        self.t = 0

    def reset(self) -> torch.Tensor:
        self.pos = torch.rand(2, generator=self.g) * 2 - 1
        self.target = torch.rand(2, generator=self.g) * 2 - 1
        self.t = 0
        return torch.cat([self.pos, self.target])

    def step(self, action: torch.Tensor) -> Tuple[torch.Tensor, float, bool]:
        self.pos = (self.pos + 0.1 * action.clamp(-1, 1)).clamp(-1.5, 1.5)
        self.t += 1
        reward = -torch.dist(self.pos, self.target).item()
        return torch.cat([self.pos, self.target]), reward, self.t >= self.LENGTH


# -- PPO clipped to a norm of 0 --------------------------------------------------------


class Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.mean = nn.Linear(64, 2)
        self.log_std = nn.Parameter(torch.full((2,), -0.5))

    def forward(self, obs: torch.Tensor) -> Normal:
        return Normal(self.mean(self.body(obs)), self.log_std.exp())


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = Actor()
        self.critic = nn.Sequential(
            nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        )


def train_ppo_clipped_to_zero(run_id: str, seed: int, updates: int = 304) -> Outcome:
    """The thread's PPO update: every mini-batch ends with
    `clip_grad_norm_(actor_critic.parameters(), spec.max_grad_norm)` and the spec says
    `max_grad_norm=0`. Adam lr 3e-4, clip range 0.2, GAE(0.99, 0.95), rollouts of
    64 steps, 4 epochs of 2 mini-batches of 32: 8 optimizer steps a rollout."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(300 + seed)
    env = Reach(g)
    policy = ActorCritic()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4, eps=1e-5)
    max_grad_norm = 0.0
    before = snapshot(policy)
    run = watch(run_id, policy, optimizer)
    obs = env.reset()
    returns: List[float] = []
    while run.steps < updates:
        observations, actions, log_probs, rewards, dones, values = [], [], [], [], [], []
        with torch.no_grad():
            for _ in range(64):
                dist = policy.actor(obs)
                action = dist.sample()
                observations.append(obs)
                actions.append(action)
                log_probs.append(dist.log_prob(action).sum())
                values.append(policy.critic(obs).squeeze())
                obs, reward, done = env.step(action)
                rewards.append(reward)
                dones.append(done)
                if done:
                    returns.append(sum(rewards[-Reach.LENGTH :]))
                    obs = env.reset()
            next_value = policy.critic(obs).squeeze()
        advantages = torch.zeros(64)
        gae = 0.0
        for t in reversed(range(64)):
            following = next_value if t == 63 else values[t + 1]
            alive = 0.0 if dones[t] else 1.0
            delta = rewards[t] + 0.99 * following * alive - values[t]
            gae = delta + 0.99 * 0.95 * alive * gae
            advantages[t] = gae
        targets = advantages + torch.stack(values)
        obs_b, act_b, logp_b = (
            torch.stack(observations),
            torch.stack(actions),
            torch.stack(log_probs),
        )
        for _ in range(4):
            order = torch.randperm(64, generator=g)
            for chunk in order.split(32):
                dist = policy.actor(obs_b[chunk])
                ratio = (dist.log_prob(act_b[chunk]).sum(-1) - logp_b[chunk]).exp()
                adv = advantages[chunk]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                policy_loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                value_loss = (
                    (policy.critic(obs_b[chunk]).squeeze(-1) - targets[chunk]).pow(2).mean()
                )
                loss = policy_loss + 0.5 * value_loss - 0.01 * dist.entropy().sum(-1).mean()
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
                optimizer.step()
                run.step(loss)
    run.close()
    total = sum(1 for _ in policy.parameters())
    return Outcome({"policy": run}, {"moved": moved(before, policy), "params": total})


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_max_grad_norm_zero(gradflow_server, gradflow_env, seed):
    """https://github.com/strands-labs/robots/pull/2028"""
    outcome = train_ppo_clipped_to_zero(gradflow_env, seed)

    # As the thread measured: not one parameter of the actor-critic moved.
    assert outcome.facts["moved"] == set(), outcome.facts

    # Backward reaches every module and the clip leaves exactly zero: PROTOCOL's
    # grad_stuck_zero with cause zero_gradient, on the actor and the critic. A cause
    # that names the clip itself (the client sees clip_grad_norm_ run) is the more
    # precise diagnosis issue 39 asks for, and counts as right too.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="policy",
            kind="grad_stuck_zero",
            covers=("actor", "critic"),
            accepts_cause=lambda cause: cause == "zero_gradient" or "clip" in (cause or ""),
        ),
    )


# -- REINFORCE whose loss grows with the return ---------------------------------------


class Pi(nn.Module):
    """The book's policy: Linear(4, 64), ReLU, Linear(64, 2) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def train_reinforce(run_id: str, seed: int, episodes: int = 300) -> Outcome:
    """The thread's standalone REINFORCE: Adam lr 0.01, gamma 0.99, one update per
    episode on `loss = -(log_probs * returns).sum()`, 300 episodes of CartPole-v0.
    Actions are sampled step by step; the log-probabilities of the episode's actions
    are then computed in one batch, the same values and graph as collecting them step
    by step (the weights do not change within an episode), in a fraction of the time."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(400 + seed)
    env = CartPole(g)
    pi = Pi()
    optimizer = torch.optim.Adam(pi.parameters(), lr=0.01)
    run = watch(run_id, pi, optimizer)
    totals, losses = [], []
    for _ in range(episodes):
        states, actions, rewards = [env.reset()], [], []
        done = False
        while not done:
            with torch.no_grad():
                p_right = torch.softmax(pi(torch.tensor(states[-1])), -1)[1].item()
            action = int(torch.rand((), generator=g).item() < p_right)
            state, reward, done = env.step(action)
            actions.append(action)
            rewards.append(reward)
            states.append(state)
        log_probs = torch.log_softmax(pi(torch.tensor(states[:-1])), -1)
        log_probs = log_probs.gather(1, torch.tensor(actions).unsqueeze(1)).squeeze(1)
        rets, future = [], 0.0
        for reward in reversed(rewards):
            future = reward + 0.99 * future
            rets.append(future)
        loss = torch.sum(-log_probs * torch.tensor(rets[::-1]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        totals.append(sum(rewards))
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"policy": run},
        {
            "return_early": mean(totals[:30]),
            "return_late": mean(totals[-30:]),
            "loss_early": mean(losses[:30]),
            "loss_late": mean(losses[-30:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_loss_grows_with_the_return(gradflow_server, gradflow_env, seed):
    """https://github.com/kengz/SLM-Lab/issues/437"""
    outcome = train_reinforce(gradflow_env, seed)

    facts = outcome.facts
    # The policy learned: the last episodes last far longer than the first ones ...
    assert facts["return_late"] > 2 * facts["return_early"], facts
    # ... and, as the thread saw, the loss grew with them.
    assert facts["loss_late"] > 2 * facts["loss_early"], facts

    assert_silent(gradflow_server, outcome)

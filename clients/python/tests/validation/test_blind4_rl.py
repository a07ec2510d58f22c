"""Reinforcement learning (the fourth set): Hands-on-RL's actor-critic on CartPole,
regrouped so that the actor's update lost its `zero_grad`.

The actor and the critic each have an optimizer of their own and are watched as two
runs. CartPole is the first set's copy of gym's CartPole-v0.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, mean, watch
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

"""Reinforcement learning (the third set): a PPO agent restarted from its saved
networks whose optimizers still hold the networks it replaced, and a healthy PPO
whose value loss climbs while its return climbs.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, snapshot, watch

pytestmark = pytest.mark.validation


# -- OFDataCommittee/drlfoam#2: restarted networks, optimizers of the old ones ---------


class FCPolicy(nn.Module):
    """drlfoam's policy: a tanh MLP giving the mean and log-std of a Gaussian action."""

    def __init__(self, states: int, hidden: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(states, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self.mean = nn.Linear(hidden, 1)
        self.log_std = nn.Linear(hidden, 1)

    def forward(self, s: torch.Tensor) -> torch.distributions.Normal:
        h = self.layers(s)
        return torch.distributions.Normal(self.mean(h), self.log_std(h).clamp(-3, 1).exp())


class FCValue(nn.Module):
    def __init__(self, states: int, hidden: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(states, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, 1),
        )

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.layers(s).squeeze(-1)


def reloaded(module: nn.Module) -> nn.Module:
    """The network read back from its saved file: a new module with new tensors."""
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


class PPOAgent:
    """drlfoam's PPOAgent: one network and one Adam each for the policy and the value,
    created in the constructor. `load` replaces the networks by the saved ones and
    keeps the optimizers, as the thread found."""

    def __init__(self, states: int) -> None:
        self.policy = FCPolicy(states)
        self.value = FCValue(states)
        self.policy_optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-3)
        self.value_optimizer = torch.optim.Adam(self.value.parameters(), lr=5e-4)

    def load(self, saved: PPOAgent) -> None:
        self.policy = reloaded(saved.policy)
        self.value = reloaded(saved.value)


def flow_control_batch(size: int, g: torch.Generator) -> torch.Tensor:
    """Probe readings of the flow; the best jet rate is a fixed linear function."""
    return torch.randn(size, 4, generator=g)


def best_action(states: torch.Tensor) -> torch.Tensor:
    return (states @ torch.tensor([[0.8], [-0.5], [0.3], [0.1]])).tanh()


def expected_reward(policy: FCPolicy, s: torch.Tensor) -> float:
    with torch.no_grad():
        return -((policy(s).mean - best_action(s)) ** 2).mean().item()


def train_restarted_ppo(run_id: str, seed: int, updates: int = 60, epochs: int = 5) -> Outcome:
    """A restart: a fresh agent loads the networks a first run saved, and PPO goes on
    (128 one-step episodes a rollout, clipped surrogate 0.1, `epochs` full-batch
    epochs for the policy and then for the value each update)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7100 + seed)
    first_run = PPOAgent(4)
    agent = PPOAgent(4)
    agent.load(first_run)
    policy_before, value_before = snapshot(agent.policy), snapshot(agent.value)
    probe = flow_control_batch(1024, g)
    reward_before = expected_reward(agent.policy, probe)
    runs = {
        "policy": watch(f"{run_id}-policy", agent.policy, agent.policy_optimizer),
        "value": watch(f"{run_id}-value", agent.value, agent.value_optimizer),
    }
    for _ in range(updates):
        states = flow_control_batch(128, g)
        with torch.no_grad():
            dist = agent.policy(states)
            actions = dist.sample()
            old_log_p = dist.log_prob(actions)
            rewards = -((actions - best_action(states)) ** 2).squeeze(1)
            advantages = rewards - agent.value(states)
            advantages = ((advantages - advantages.mean()) / (advantages.std() + 1e-8)).unsqueeze(1)
        for _ in range(epochs):
            ratio = (agent.policy(states).log_prob(actions) - old_log_p).exp()
            policy_loss = -torch.min(ratio * advantages, ratio.clamp(0.9, 1.1) * advantages).mean()
            agent.policy_optimizer.zero_grad()
            policy_loss.backward()
            agent.policy_optimizer.step()
            runs["policy"].step(policy_loss)
        for _ in range(epochs):
            value_loss = F.mse_loss(agent.value(states), rewards)
            agent.value_optimizer.zero_grad()
            value_loss.backward()
            agent.value_optimizer.step()
            runs["value"].step(value_loss)
    for run in runs.values():
        run.close()
    return Outcome(
        runs,
        {
            "policy_moved": [
                n
                for n, p in agent.policy.named_parameters()
                if not torch.equal(p, policy_before[n])
            ],
            "value_moved": [
                n for n, p in agent.value.named_parameters() if not torch.equal(p, value_before[n])
            ],
            "policy_grads": all(p.grad is not None for p in agent.policy.parameters()),
            "reward_before": reward_before,
            "reward_after": expected_reward(agent.policy, probe),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_restart_keeps_optimizers_of_the_old_networks(gradflow_server, gradflow_env, seed):
    """https://github.com/OFDataCommittee/drlfoam/issues/2"""
    outcome = train_restarted_ppo(gradflow_env, seed)

    # Backward fills the loaded networks' gradients, and not one of their weights moves:
    # the optimizers step the tensors the load replaced. The policy's reward stands still.
    facts = outcome.facts
    assert facts["policy_grads"], facts
    assert facts["policy_moved"] == [] and facts["value_moved"] == [], facts
    assert facts["reward_after"] == facts["reward_before"], facts

    # The correct verdict: the trained networks' parameters are outside their optimizers
    # (PROTOCOL: param_not_in_optimizer; cause not_in_optimizer, or replaced_after_
    # optimizer where the names now resolve to new tensors), on the policy's run at least.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="policy",
            kind="param_not_in_optimizer",
            causes=("not_in_optimizer", "replaced_after_optimizer"),
        ),
    )


# -- Stanford-ILIAD/PantheonRL#5: the value loss climbs with the return ----------------


class ActorCritic(nn.Module):
    """SB3's MlpPolicy in small: separate 64-unit tanh networks for the policy and the
    value, one Adam for both."""

    def __init__(self, states: int, actions: int) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(states, 64), nn.Tanh(), nn.Linear(64, actions))
        self.vf = nn.Sequential(nn.Linear(states + 1, 64), nn.Tanh(), nn.Linear(64, 1))


def train_sb3_ppo(run_id: str, seed: int, rollouts: int = 24) -> Outcome:
    """SB3's PPO defaults on a dish-serving task (64-step episodes; reward 1 when the
    agent serves the dish the order asks for): n_steps 256, batch 64, 4 epochs, lr 3e-4,
    clip 0.2, GAE 0.95, gamma 0.99, vf_coef 0.5, max_grad_norm 0.5. The value network
    also reads the episode's elapsed time."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7200 + seed)
    kinds, n, episode = 4, 256, 64
    model = ActorCritic(kinds, kinds)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4, eps=1e-5)
    run = watch(run_id, model, optimizer)
    t, served, value_losses = 0, [], []
    order = int(torch.randint(0, kinds, (1,), generator=g))
    for _ in range(rollouts):
        states, actions, rewards, log_ps, dones = [], [], [], [], []
        for _ in range(n):
            s = F.one_hot(torch.tensor(order), kinds).float()
            with torch.no_grad():
                dist = torch.distributions.Categorical(logits=model.pi(s))
                a = dist.sample()
            rewards.append(1.0 if int(a) == (order + 1) % kinds else 0.0)
            states.append(torch.cat([s, torch.tensor([t / episode])]))
            actions.append(a)
            log_ps.append(dist.log_prob(a))
            t += 1
            dones.append(t >= episode)
            t = 0 if t >= episode else t
            order = int(torch.randint(0, kinds, (1,), generator=g))
        S, A, LP, R = (
            torch.stack(states),
            torch.stack(actions),
            torch.stack(log_ps),
            torch.tensor(rewards),
        )
        served.append(R.sum().item())
        with torch.no_grad():
            V = model.vf(S).squeeze(1)
        advantages, last = torch.zeros(n), 0.0
        for i in reversed(range(n)):
            alive = 0.0 if dones[i] else 1.0
            following = V[i + 1] if i + 1 < n else V[i]
            delta = R[i] + 0.99 * following * alive - V[i]
            last = delta + 0.99 * 0.95 * alive * last
            advantages[i] = last
        returns = advantages + V
        for _ in range(4):
            for batch in torch.randperm(n, generator=g).split(64):
                dist = torch.distributions.Categorical(logits=model.pi(S[batch, :kinds]))
                ratio = (dist.log_prob(A[batch]) - LP[batch]).exp()
                adv = advantages[batch]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                policy_loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                value_loss = F.mse_loss(model.vf(S[batch]).squeeze(1), returns[batch])
                loss = policy_loss + 0.5 * value_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                value_losses.append(value_loss.item())
                run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "served_first": mean(served[:4]),
            "served_last": mean(served[-4:]),
            "value_loss_early": mean(value_losses[16:64]),
            "value_loss_late": mean(value_losses[-64:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_value_loss_climbs_with_the_return(gradflow_server, gradflow_env, seed):
    """https://github.com/Stanford-ILIAD/PantheonRL/issues/5"""
    outcome = train_sb3_ppo(gradflow_env, seed)

    # The agent serves far more dishes by the end, and the value loss grew with the
    # returns it has to predict.
    facts = outcome.facts
    assert facts["served_last"] > 1.3 * facts["served_first"], facts
    assert facts["value_loss_late"] > 1.3 * facts["value_loss_early"], facts

    # Healthy: a value loss growing with the return is PPO learning.
    assert_silent(gradflow_server, outcome)

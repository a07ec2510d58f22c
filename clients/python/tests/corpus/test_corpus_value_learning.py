"""Corpus: healthy value-based reinforcement learning whose loss jumps by design. A
DQN copies its online network into the target network every 100 steps (the "hard"
update of the DQN papers and of PyTorch's first DQN tutorial); at each copy the
bootstrapped targets move at once and the TD loss jumps by one to two orders of
magnitude, then falls back as the online network catches up with them. Training is
healthy: the Q-values approach the true ones and the greedy policy reaches the goal.

Each seed runs 400 steps: three times `loss_spike`'s window of 128 readings (the
longest of the loss rules involved), four target copies.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from corpus_loops import fit
from corpus_support import Progress, expects_silence, judge
from torch import nn

# Every case here is a healthy run (the corpus table counts them as look-alikes).
SEEDS = [0, 1, 2]
STEPS = 600

# A corridor of `CELLS` cells: step left or right, reward 1 on reaching the last cell
# (the episode ends), 0 otherwise; episodes start in a random cell.
CELLS = 6
GAMMA = 0.9
# Every this many optimizer steps the target network takes the online one's weights.
TARGET_EVERY = 100
BATCH = 32


def one_hot(cell: torch.Tensor) -> torch.Tensor:
    return nn.functional.one_hot(cell, CELLS).float()


def true_values() -> torch.Tensor:
    """Q*(cell, action) of the corridor, by value iteration (cells x 2)."""
    q = torch.zeros(CELLS, 2)
    for _ in range(200):
        v = q.max(1).values
        v[-1] = 0.0  # the goal is terminal
        for cell in range(CELLS - 1):
            for action, to in ((0, max(cell - 1, 0)), (1, cell + 1)):
                q[cell, action] = 1.0 if to == CELLS - 1 else GAMMA * v[to]
    return q[: CELLS - 1]


def random_transitions(g: torch.Generator) -> Tuple[torch.Tensor, ...]:
    """4096 transitions of a uniformly random policy (off-policy replay, as DQN
    learns): the cells, actions, next cells and rewards."""
    cells = torch.randint(0, CELLS - 1, (4096,), generator=g)
    actions = torch.randint(0, 2, (4096,), generator=g)
    nexts = torch.where(actions == 1, cells + 1, (cells - 1).clamp(min=0))
    return cells, actions, nexts, (nexts == CELLS - 1).float()


def dqn(seed: int) -> Tuple[str, List[float], float, float, int]:
    """DQN on the corridor with a replay buffer filled by a random policy, Adam at
    1e-3, the Huber loss of the tutorial, a hard target copy every `TARGET_EVERY`
    steps. Returns the run id, the losses, the Q-values' mean absolute error against
    Q* before and after, and how many cells the greedy policy walks straight to the
    goal from."""
    torch.manual_seed(seed)
    online = nn.Sequential(nn.Linear(CELLS, 64), nn.ReLU(), nn.Linear(64, 2))
    target = nn.Sequential(nn.Linear(CELLS, 64), nn.ReLU(), nn.Linear(64, 2))
    target.load_state_dict(online.state_dict())
    optimizer = torch.optim.Adam(online.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + seed)
    cells, actions, nexts, rewards = random_transitions(g)
    done = rewards
    states = torch.arange(CELLS - 1)
    q_star = true_values()

    def error() -> float:
        with torch.no_grad():
            return float((online(one_hot(states)) - q_star).abs().mean())

    def copy_target(i: int) -> None:
        if i > 0 and i % TARGET_EVERY == 0:
            target.load_state_dict(online.state_dict())

    def td_loss() -> torch.Tensor:
        pick = torch.randint(0, len(cells), (BATCH,), generator=g)
        q = online(one_hot(cells[pick])).gather(1, actions[pick, None]).squeeze(1)
        with torch.no_grad():
            best_next = target(one_hot(nexts[pick])).max(1).values
            goal = rewards[pick] + GAMMA * best_next * (1 - done[pick])
        return nn.functional.smooth_l1_loss(q, goal)

    start = error()
    run_id, losses = fit(online, optimizer, td_loss, STEPS, before=copy_target)
    with torch.no_grad():
        greedy = online(one_hot(states)).argmax(1)
    return run_id, losses, start, error(), int((greedy == 1).sum())


def jumps_at_copies(losses: List[float]) -> List[float]:
    """For each target copy, the highest of the three losses after it against the
    median of the ten before it."""
    jumps = []
    for copy in range(TARGET_EVERY, STEPS, TARGET_EVERY):
        before = sorted(losses[copy - 10 : copy])[5]
        jumps.append(max(losses[copy : copy + 3]) / before)
    return jumps


@expects_silence
@pytest.mark.parametrize("seed", SEEDS)
def test_a_dqn_loss_that_jumps_at_every_target_copy(request, gradflow_server, gradflow_env, seed):
    """The TD loss jumps at each hard target-network update, then falls back ("every
    time target_net is updated, at 200, 400, 600, the loss fluctuates"; the DQN
    tutorial's loss "becomes bigger and bigger" while the return holds at its
    best), while the Q-values converge.

    Threads: https://github.com/CodeRayZhang/Reinforcement-Learning/issues/1,
    https://github.com/tensorflow/agents/issues/316
    """
    run_id, losses, start, end, right = dqn(seed)
    # Once the online network has fitted the frozen targets (every copy after the
    # first), each copy makes the loss jump by two orders of magnitude or more.
    jumps = jumps_at_copies(losses)
    assert min(jumps[1:]) > 100, jumps
    assert right == CELLS - 1  # the greedy policy heads for the goal from every cell
    converged = Progress("distance of the Q-values from Q*", start, end, by=0.5)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=converged)


# -- soft-updated target networks that require grad -------------------------------------

# The target's share of the online weights at each soft update (DDPG's and MADDPG's
# tau).
TAU = 0.01


class Agent(nn.Module):
    """The online Q-network and its target as submodules of one agent, the target built
    as a copy of the online network and left with `requires_grad=True`."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(CELLS, 64), nn.ReLU(), nn.Linear(64, 2))
        self.critic_target = nn.Sequential(nn.Linear(CELLS, 64), nn.ReLU(), nn.Linear(64, 2))
        self.critic_target.load_state_dict(self.critic.state_dict())


def soft_target_dqn(seed: int) -> Tuple[str, List[float], float, float, int, int]:
    """The corridor's Q-learning with a target network soft-updated after every step
    (target = (1 - TAU) target + TAU online, in place under `no_grad`), held with the
    online network by one Adam over the whole agent, as stable-baselines3 lays a DQN
    out. Returns the run id, the losses, the Q-values' error against Q* before and
    after, the cells the greedy policy walks straight from, and how many steps gave
    the target a gradient."""
    torch.manual_seed(seed)
    agent = Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(200 + seed)
    cells, actions, nexts, rewards = random_transitions(g)
    states = torch.arange(CELLS - 1)
    q_star = true_values()
    target_grads = 0

    def error() -> float:
        with torch.no_grad():
            return float((agent.critic(one_hot(states)) - q_star).abs().mean())

    def soft_update(i: int) -> None:
        nonlocal target_grads
        target_grads += sum(p.grad is not None for p in agent.critic_target.parameters())
        if i == 0:
            return
        with torch.no_grad():
            for tp, p in zip(agent.critic_target.parameters(), agent.critic.parameters()):
                tp.copy_((1 - TAU) * tp + TAU * p)

    def td_loss() -> torch.Tensor:
        pick = torch.randint(0, len(cells), (BATCH,), generator=g)
        q = agent.critic(one_hot(cells[pick])).gather(1, actions[pick, None]).squeeze(1)
        with torch.no_grad():
            best_next = agent.critic_target(one_hot(nexts[pick])).max(1).values
            goal = rewards[pick] + GAMMA * best_next * (1 - rewards[pick])
        return nn.functional.mse_loss(q, goal)

    start = error()
    run_id, losses = fit(agent, optimizer, td_loss, STEPS, before=soft_update)
    with torch.no_grad():
        greedy = agent.critic(one_hot(states)).argmax(1)
    return run_id, losses, start, error(), int((greedy == 1).sum()), target_grads


@expects_silence
@pytest.mark.parametrize("seed", SEEDS)
def test_a_soft_updated_target_network_that_requires_grad(
    request, gradflow_server, gradflow_env, seed
):
    """The target network keeps `requires_grad=True` ("the target network's fully
    connected weights and biases have requires_grad=True") and sits in the optimizer
    with the online network, yet backward never reaches it: its forward runs under
    `no_grad`, and its weights move only by the soft update. Not a graph cut: a cut
    module's weights never move.

    Threads: https://github.com/starry-sky6688/MADDPG/issues/25 (the target networks
    of MADDPG, soft-updated with tau after every step),
    https://github.com/philtabor/Multi-Agent-Deep-Deterministic-Policy-Gradients/issues/10
    """
    run_id, losses, start, end, right, target_grads = soft_target_dqn(seed)
    # Alarming to a rule that reads gradients alone: half the optimizer's parameters
    # never get one, over the whole run ...
    assert target_grads == 0
    # ... while the online network learns the values and the greedy policy.
    assert right == CELLS - 1
    converged = Progress("distance of the Q-values from Q*", start, end, by=0.5)
    judge(request, gradflow_server, run_id, steps=STEPS, progress=converged)

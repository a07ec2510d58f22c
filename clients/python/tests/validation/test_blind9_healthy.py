"""Healthy runs of the ninth set whose numbers look alarming: SimSiam's loss going
negative, a GAT whose training accuracy trails far behind, a DQN whose loss swings
while its return rises, the PyTorch VAE example's climbing KL, MADDPG's negative
actor losses, and a SchNet-style regressor under Lightning whose loss jumps from batch
to batch."""

from __future__ import annotations

import copy
import math
import random
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, Run, assert_silent, dry, mean, watch

pytestmark = pytest.mark.validation


# -- facebookresearch/simsiam#44: the negative cosine similarity goes below 0 ------------


class SimSiam(nn.Module):
    """A small CNN backbone, SimSiam's projector (with batch norm) and predictor."""

    def __init__(self, dim: int = 32, pred: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.projector = nn.Sequential(
            nn.Linear(32, dim, bias=False),
            nn.BatchNorm1d(dim),
            nn.ReLU(),
            nn.Linear(dim, dim, bias=False),
            nn.BatchNorm1d(dim, affine=False),
        )
        self.predictor = nn.Sequential(
            nn.Linear(dim, pred, bias=False), nn.BatchNorm1d(pred), nn.ReLU(), nn.Linear(pred, dim)
        )

    def forward(self, x1: torch.Tensor, x2: torch.Tensor):
        z1, z2 = self.projector(self.encoder(x1)), self.projector(self.encoder(x2))
        return self.predictor(z1), self.predictor(z2), z1.detach(), z2.detach()


def few_shot_images(n: int, g: torch.Generator, classes: int = 5):
    label = torch.randint(0, classes, (n,), generator=g)
    templates = torch.Generator().manual_seed(99)
    pattern = torch.randn(classes, 1, 12, 12, generator=templates)
    return pattern[label], label


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random shifts, gain and noise."""
    shift = int(torch.randint(-2, 3, (1,), generator=g))
    gain = torch.rand(len(x), 1, 1, 1, generator=g) + 0.5
    return gain * torch.roll(x, shift, dims=3) + 0.5 * torch.randn(x.shape, generator=g)


def knn_accuracy(model: SimSiam, g: torch.Generator) -> float:
    model.eval()
    with torch.no_grad():
        bank, bank_y = few_shot_images(200, g)
        query, query_y = few_shot_images(200, g)
        fb = F.normalize(model.encoder(augment(bank, g)), dim=1)
        fq = F.normalize(model.encoder(augment(query, g)), dim=1)
        pred = bank_y[(fq @ fb.T).argmax(1)]
    model.train()
    return (pred == query_y).float().mean().item()


def train_simsiam(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """SimSiam's `main_simsiam.py` at small size: SGD (lr 0.05 x batch / 256 scaled up
    for 64 images, momentum 0.9, wd 1e-4) with a cosine schedule, the symmetric
    negative cosine `-(cos(p1, z2) + cos(p2, z1)) / 2` with stop-gradient on z."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9800 + seed)
    model = SimSiam()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    before = knn_accuracy(model, g)
    run = watch(run_id, model, optimizer)
    losses = []
    for _ in range(steps):
        x, _label = few_shot_images(64, g)
        p1, p2, z1, z2 = model(augment(x, g), augment(x, g))
        loss = -(F.cosine_similarity(p1, z2).mean() + F.cosine_similarity(p2, z1).mean()) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        run.step(loss)
    run.close()
    with torch.no_grad():
        model.eval()
        z = F.normalize(
            model.projector(model.encoder(augment(few_shot_images(256, g)[0], g))), dim=1
        )
        model.train()
    return Outcome(
        {"model": run},
        {
            "losses": losses,
            "before": before,
            "after": knn_accuracy(model, g),
            "spread": z.std(0).mean().item() * math.sqrt(z.shape[1]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_simsiam_loss_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/facebookresearch/simsiam/issues/44"""
    outcome = train_simsiam(gradflow_env, seed)

    # The loss falls from about 0 towards -1 (below -0.6); the outputs did not collapse (their
    # spread stays near 1, a collapsed output's is 0) and the features' nearest
    # neighbours find the right class more often than at the start.
    facts = outcome.facts
    assert mean(facts["losses"][:5]) > -0.2 and mean(facts["losses"][-20:]) < -0.6, facts
    assert facts["spread"] > 0.5, facts
    assert facts["after"] > 0.9 and facts["after"] >= facts["before"], facts

    assert_silent(gradflow_server, outcome)


# -- PetarV-/GAT#7: training accuracy far below validation accuracy -----------------------


class GATLayer(nn.Module):
    def __init__(self, fin: int, fout: int, heads: int, dropout: float, concat: bool) -> None:
        super().__init__()
        self.heads, self.fout, self.concat, self.dropout = heads, fout, concat, dropout
        self.w = nn.Linear(fin, heads * fout, bias=False)
        self.a_src = nn.Parameter(torch.randn(heads, fout) * 0.1)
        self.a_dst = nn.Parameter(torch.randn(heads, fout) * 0.1)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = F.dropout(x, self.dropout, self.training)
        h = self.w(x).view(n, self.heads, self.fout)
        e = (h * self.a_src).sum(-1)[:, None, :] + (h * self.a_dst).sum(-1)[None, :, :]
        e = F.leaky_relu(e, 0.2).masked_fill(~adj[..., None], float("-inf"))
        alpha = F.dropout(torch.softmax(e, 1), self.dropout, self.training)
        out = torch.einsum("ijh,jhf->ihf", alpha, h)
        return out.reshape(n, -1) if self.concat else out.mean(1)


class GAT(nn.Module):
    """The Cora GAT: 8 heads of 8 features with ELU, one output head; dropout 0.6 on
    the inputs and on the attention coefficients of both layers."""

    def __init__(self, fin: int, classes: int) -> None:
        super().__init__()
        self.layer1 = GATLayer(fin, 8, 8, 0.6, concat=True)
        self.layer2 = GATLayer(64, classes, 1, 0.6, concat=False)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.elu(self.layer1(x, adj)), adj)


def citation_graph(g: torch.Generator, n: int = 120, classes: int = 4, fin: int = 64):
    """A stochastic block model with sparse bag-of-words features that say little on
    their own: the neighbours carry the class."""
    label = torch.randint(0, classes, (n,), generator=g)
    same = label[:, None] == label[None, :]
    p = torch.where(same, torch.tensor(0.1), torch.tensor(0.006))
    adj = torch.rand(n, n, generator=g) < p
    adj = adj | adj.T | torch.eye(n, dtype=torch.bool)
    topic = torch.rand(classes, fin, generator=g) < 0.15
    words = torch.rand(n, fin, generator=g)
    x = ((words < 0.06) | (topic[label] & (torch.rand(n, fin, generator=g) < 0.15))).float()
    x = x / x.sum(1, keepdim=True).clamp(min=1)
    return x, adj, label


def train_gat(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Adam lr 0.005, wd 5e-4, full-batch: one optimizer step an epoch; 20 labelled
    nodes a class, the rest held out."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9900 + seed)
    x, adj, label = citation_graph(g)
    train = torch.zeros(len(label), dtype=torch.bool)
    for c in range(4):
        train[(label == c).nonzero()[:20, 0]] = True
    model = GAT(x.shape[1], 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    run = watch(run_id, model, optimizer)
    train_acc = []
    for _ in range(steps):
        out = model(x, adj)
        loss = F.cross_entropy(out[train], label[train])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train_acc.append((out[train].argmax(1) == label[train]).float().mean().item())
        run.step(loss)
    run.close()
    model.eval()
    with torch.no_grad():
        pred = model(x, adj).argmax(1)
    return Outcome(
        {"model": run},
        {
            "train_acc": mean(train_acc[-50:]),
            "val_acc": (pred[~train] == label[~train]).float().mean().item(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_gat_training_accuracy_trails_validation(gradflow_server, gradflow_env, seed):
    """https://github.com/PetarV-/GAT/issues/7"""
    outcome = train_gat(gradflow_env, seed)

    # Under dropout the training nodes are often mispredicted; without it the
    # held-out nodes mostly are not.
    facts = outcome.facts
    assert facts["val_acc"] > 0.8 and facts["val_acc"] > facts["train_acc"] + 0.05, facts

    assert_silent(gradflow_server, outcome)


# -- DeepRLChinese/DeepRL-Chinese#3: the DQN loss swings while the return rises -----------


class Chain:
    """A corridor of 8 cells: left or right; +1 at the right end, which ends the
    episode, -0.01 a step, 40 steps at most; episodes start in one of the first six."""

    def __init__(self, rng: random.Random, length: int = 8) -> None:
        self.rng, self.length = rng, length

    def reset(self) -> int:
        self.pos, self.t = self.rng.randrange(0, 6), 0
        return self.pos

    def step(self, action: int):
        self.pos = max(0, min(self.length - 1, self.pos + (1 if action else -1)))
        self.t += 1
        done = self.pos == self.length - 1
        return self.pos, (1.0 if done else -0.01), done or self.t >= 40, done


def one_hot(states, n: int = 8) -> torch.Tensor:
    return F.one_hot(torch.as_tensor(states), n).float()


def value_error(q: nn.Module, gamma: float = 0.9, length: int = 8) -> float:
    """The mean distance between the network's best Q-value and the true optimal value
    of each non-terminal cell."""
    errors = []
    for p in range(length - 1):
        d = length - 1 - p
        true = -0.01 * (1 - gamma ** (d - 1)) / (1 - gamma) + gamma ** (d - 1)
        with torch.no_grad():
            errors.append(abs(q(one_hot([p])).max().item() - true))
    return mean(errors)


def greedy_successes(q: nn.Module, rng: random.Random) -> int:
    """From how many of the six starting cells the greedy policy reaches the goal."""
    env, wins = Chain(rng), 0
    for start in range(6):
        env.reset()
        env.pos = s = start
        done = goal = False
        while not done:
            with torch.no_grad():
                a = int(q(one_hot([s])).argmax())
            s, _r, done, goal = env.step(a)
        wins += goal
    return wins


def train_dqn(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The book's `dqn.py`: an MLP Q-network, a replay buffer, epsilon decaying from 1
    to 0.05, a target network softly updated (tau 0.05) by hand, gamma 0.9, MSE on the TD target,
    Adam 1e-3, batches of 32 after 64 warm-up transitions, one update an env step."""
    torch.manual_seed(seed)
    rng = random.Random(10000 + seed)
    q = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    target = copy.deepcopy(q)
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-3)
    before = value_error(q)
    env, buffer = Chain(rng), []
    s = env.reset()
    for _ in range(64):
        a = rng.randrange(2)
        s2, r, done, goal = env.step(a)
        buffer.append((s, a, r, s2, goal))
        s = env.reset() if done else s2
    run = watch(run_id, q, optimizer)
    losses = []
    for step in range(steps):
        eps = max(0.05, 1.0 - step / 200)
        with torch.no_grad():
            a = rng.randrange(2) if rng.random() < eps else int(q(one_hot([s])).argmax())
        s2, r, done, goal = env.step(a)
        buffer.append((s, a, r, s2, goal))
        s = env.reset() if done else s2
        batch = rng.sample(buffer, 32)
        bs, ba, br, bs2, bd = (torch.tensor(v) for v in zip(*batch))
        with torch.no_grad():
            y = br.float() + 0.9 * (1 - bd.float()) * target(one_hot(bs2)).max(1).values
        pred = q(one_hot(bs)).gather(1, ba[:, None])[:, 0]
        loss = F.mse_loss(pred, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for p, pt in zip(q.parameters(), target.parameters()):
                pt.mul_(0.95).add_(0.05 * p)
        losses.append(loss.item())
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "losses": losses,
            "before": before,
            "after": value_error(q),
            "successes": greedy_successes(q, rng),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_dqn_loss_swings_while_the_return_rises(gradflow_server, gradflow_env, seed):
    """https://github.com/DeepRLChinese/DeepRL-Chinese/issues/3"""
    outcome = train_dqn(gradflow_env, seed)

    # The greedy policy walks to the goal from every start and the Q-values approach
    # the true values; the TD loss does not fall with them.
    facts = outcome.facts
    assert facts["successes"] == 6 and facts["after"] < 0.5 * facts["before"], facts
    assert max(facts["losses"][150:]) > 2 * min(facts["losses"][150:]), facts["losses"][::20]

    assert_silent(gradflow_server, outcome)


# -- pytorch/examples#631: the VAE example's KL term increases ----------------------------


class VAE(nn.Module):
    """The example's VAE at small size: 64 -> 128 -> (mu, logvar) of 8 -> 128 -> 64."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc21 = nn.Linear(128, 8)
        self.fc22 = nn.Linear(128, 8)
        self.fc3 = nn.Linear(8, 128)
        self.fc4 = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor):
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def strokes(n: int, g: torch.Generator) -> torch.Tensor:
    """8x8 binary images: one horizontal and one vertical bar at random places."""
    img = torch.zeros(n, 8, 8)
    rows = torch.randint(0, 8, (n,), generator=g)
    cols = torch.randint(0, 8, (n,), generator=g)
    img[torch.arange(n), rows, :] = 1
    img[torch.arange(n), :, cols] = 1
    return img.view(n, 64)


def train_vae(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """`vae/main.py`: Adam 1e-3, batches of 128, the loss the sum of the binary
    cross-entropy and the KL divergence over the batch."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10100 + seed)
    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    kls, bces = [], []
    for _ in range(steps):
        x = strokes(128, g)
        recon, mu, logvar = model(x)
        bce = F.binary_cross_entropy(recon, x, reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        loss = bce + kld
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kls.append(kld.item())
        bces.append(bce.item())
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"kl": kls, "bce": bces})


@pytest.mark.parametrize("seed", SEEDS)
def test_vae_kl_rises_while_the_loss_falls(gradflow_server, gradflow_env, seed):
    """https://github.com/pytorch/examples/issues/631"""
    outcome = train_vae(gradflow_env, seed)

    # The KL term climbs several-fold while the reconstruction term, and the total,
    # fall: the latents start carrying information.
    kl, bce = outcome.facts["kl"], outcome.facts["bce"]
    assert mean(kl[-20:]) > 3 * mean(kl[:5]), (kl[:5], kl[-5:])
    assert mean(bce[-20:]) + mean(kl[-20:]) < 0.7 * (mean(bce[:5]) + mean(kl[:5]))

    assert_silent(gradflow_server, outcome)


# -- xuehy/pytorch-maddpg#10: the actors' losses go negative ------------------------------


class Actor(nn.Module):
    def __init__(self, obs: int, act: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, 64), nn.ReLU(), nn.Linear(64, act), nn.Tanh())

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        return self.net(o)


class Critic(nn.Module):
    """A centralised critic: every agent's observation and action."""

    def __init__(self, obs: int, act: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs + act, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, o: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([o, a], 1))[:, 0]


def observe(pos: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """Each agent sees every agent's offset to its landmark."""
    return (goal - pos).reshape(len(pos), -1)


def episode_reward(pos: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """Shared: 1 less the mean distance to the landmarks, positive near them."""
    return 1.0 - (goal - pos).norm(dim=-1).mean(-1)


def rollout_distance(actors, g: torch.Generator, episodes: int = 20) -> float:
    pos = torch.rand(episodes, 2, 2, generator=g) * 2 - 1
    goal = torch.rand(episodes, 2, 2, generator=g) * 2 - 1
    with torch.no_grad():
        for _ in range(15):
            o = observe(pos, goal)
            act = torch.stack([a(o) for a in actors], 1)
            pos = (pos + 0.1 * act).clamp(-1.5, 1.5)
    return (goal - pos).norm(dim=-1).mean().item()


def train_maddpg(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Two agents on cooperative navigation, the repository's MADDPG: per agent an
    actor (Adam 1e-3) and a centralised critic (Adam 1e-2), soft target updates (tau
    0.01) by hand, gamma 0.95, the actor loss `-critic(o, a).mean()`, batches of 64
    from a replay buffer, Gaussian exploration noise; one update of each network a
    step of 8 parallel episodes of 15 moves."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10200 + seed)
    obs, act = 4, 4
    actors = [Actor(obs, 2) for _ in range(2)]
    critics = [Critic(obs, act) for _ in range(2)]
    t_actors, t_critics = copy.deepcopy(actors), copy.deepcopy(critics)
    a_opts = [torch.optim.Adam(a.parameters(), lr=1e-3) for a in actors]
    c_opts = [torch.optim.Adam(c.parameters(), lr=1e-2) for c in critics]
    before = rollout_distance(actors, g)
    runs = {}
    for i in range(2):
        runs[f"actor{i}"] = watch(f"{run_id}-actor{i}", actors[i], a_opts[i])
        runs[f"critic{i}"] = watch(f"{run_id}-critic{i}", critics[i], c_opts[i])
    buf_o, buf_a, buf_r, buf_o2 = [], [], [], []
    pos = torch.rand(8, 2, 2, generator=g) * 2 - 1
    goal = torch.rand(8, 2, 2, generator=g) * 2 - 1
    t = 0
    actor_losses = []
    for _ in range(steps):
        o = observe(pos, goal)
        with torch.no_grad():
            a = torch.stack([ac(o) for ac in actors], 1)
            a = (a + 0.3 * torch.randn(a.shape, generator=g)).clamp(-1, 1)
        pos = (pos + 0.1 * a).clamp(-1.5, 1.5)
        buf_o.append(o)
        buf_a.append(a.reshape(8, -1))
        buf_r.append(episode_reward(pos, goal))
        buf_o2.append(observe(pos, goal))
        t += 1
        if t == 15:
            t = 0
            pos = torch.rand(8, 2, 2, generator=g) * 2 - 1
            goal = torch.rand(8, 2, 2, generator=g) * 2 - 1
        bo, ba, br, bo2 = (torch.cat(b[-400:]) for b in (buf_o, buf_a, buf_r, buf_o2))
        idx = torch.randint(0, len(bo), (64,), generator=g)
        bo, ba, br, bo2 = bo[idx], ba[idx], br[idx], bo2[idx]
        with torch.no_grad():
            a2 = torch.cat([ta(bo2) for ta in t_actors], 1)
        step_losses = []
        for i in range(2):
            with torch.no_grad():
                y = br + 0.95 * t_critics[i](bo2, a2)
            c_loss = F.mse_loss(critics[i](bo, ba), y)
            c_opts[i].zero_grad()
            c_loss.backward()
            c_opts[i].step()
            runs[f"critic{i}"].step(c_loss)
            joint = ba.clone()
            joint[:, 2 * i : 2 * i + 2] = actors[i](bo)
            a_loss = -critics[i](bo, joint).mean()
            a_opts[i].zero_grad()
            a_loss.backward()
            a_opts[i].step()
            runs[f"actor{i}"].step(a_loss)
            step_losses.append(a_loss.item())
        actor_losses.append(mean(step_losses))
        with torch.no_grad():
            for net, tnet in zip(actors + critics, t_actors + t_critics):
                for p, pt in zip(net.parameters(), tnet.parameters()):
                    pt.mul_(0.99).add_(0.01 * p)
    for r in runs.values():
        r.close()
    return Outcome(
        runs,
        {
            "actor_losses": actor_losses,
            "before": before,
            "after": rollout_distance(actors, g),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_maddpg_actor_losses_go_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/xuehy/pytorch-maddpg/issues/10"""
    outcome = train_maddpg(gradflow_env, seed)

    # The agents end nearer their landmarks than at the start; the actor loss, the
    # negated Q-value, falls well below zero as the critics' values grow.
    facts = outcome.facts
    assert facts["after"] < 0.6 * facts["before"], (facts["before"], facts["after"])
    late, early = mean(facts["actor_losses"][-20:]), mean(facts["actor_losses"][:20])
    assert late < -0.5 and late < early - 0.5, (early, late)

    assert_silent(gradflow_server, outcome)


# -- atomistic-machine-learning/schnetpack#639: the loss jumps between batches -----------


def molecules(n: int, g: torch.Generator, atoms: int = 6):
    """Random 'molecules' of six atoms of four types; the energy is a reference energy
    a type (what the atom count explains, as in QM9) plus pair terms that depend on
    both types and fall off with distance."""
    types = torch.randint(0, 4, (n, atoms), generator=g)
    pos = torch.randn(n, atoms, 3, generator=g) * 1.2
    d = torch.cdist(pos, pos)
    eps = torch.tensor(
        [[1.0, 0.5, 0.2, 0.8], [0.5, 1.5, 0.3, 0.1], [0.2, 0.3, 0.6, 0.9], [0.8, 0.1, 0.9, 1.2]]
    )
    pair = eps[types[:, :, None], types[:, None, :]] * torch.exp(-d)
    mask = ~torch.eye(atoms, dtype=torch.bool)
    energy = (pair * mask).sum((1, 2)) / 2
    energy = energy + torch.tensor([-1.0, -2.5, 0.5, -4.0])[types].sum(1)
    return types, pos, energy


def train_lightning_schnet(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A SchNet-style model (type embeddings, two continuous-filter interaction
    blocks on Gaussian-expanded distances, an atom-wise readout summed over atoms) as
    a `LightningModule`, AdamW 5e-4 as schnetpack's default, batches of 2 as the
    thread's: the per-batch MSE swings by orders of magnitude. Watched by gradflow's
    Lightning callback."""
    import lightning

    from gradflow.integrations.lightning import GradflowCallback

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10300 + seed)

    class Interaction(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.filter = nn.Sequential(nn.Linear(16, dim), nn.Tanh(), nn.Linear(dim, dim))
            self.update = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))

        def forward(self, h, rbf, mask):
            w = self.filter(rbf) * mask[..., None]
            return h + self.update((w * h[:, None, :, :]).sum(2))

    class SchNetLite(lightning.LightningModule):
        def __init__(self, dim: int = 32) -> None:
            super().__init__()
            self.embedding = nn.Embedding(4, dim)
            self.interactions = nn.ModuleList(Interaction(dim) for _ in range(2))
            self.readout = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1))
            self.register_buffer("centers", torch.linspace(0, 5, 16))

        def forward(self, types, pos):
            d = torch.cdist(pos, pos)
            rbf = torch.exp(-4.0 * (d[..., None] - self.centers) ** 2)
            mask = (~torch.eye(pos.shape[1], dtype=torch.bool)).float()[None]
            h = self.embedding(types)
            for block in self.interactions:
                h = block(h, rbf, mask)
            return self.readout(h)[..., 0].sum(1)

        def training_step(self, batch, _):
            types, pos, energy = batch
            return F.mse_loss(self(types, pos), energy)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=5e-4)

    types, pos, energy = molecules(steps * 2, g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(types, pos, energy), batch_size=2
    )
    test_types, test_pos, test_energy = molecules(300, g)
    model = SchNetLite()

    def test_mae() -> float:
        with torch.no_grad():
            return (model(test_types, test_pos) - test_energy).abs().mean().item()

    before = test_mae()
    baseline = (test_energy - energy.mean()).abs().mean().item()
    losses = []

    class Record(lightning.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    if dry():
        warnings.simplefilter("ignore")
    callback = GradflowCallback(run_id=run_id, **({"on_alert": None} if dry() else {}))
    trainer = lightning.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=[callback, Record()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return Outcome(
        {"model": Run(run_id, steps=trainer.global_step)},
        {"before": before, "after": test_mae(), "baseline": baseline, "losses": losses},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_lightning_schnet_loss_jumps_between_batches(gradflow_server, gradflow_env, seed):
    """https://github.com/atomistic-machine-learning/schnetpack/issues/639"""
    outcome = train_lightning_schnet(gradflow_env, seed)

    # The held-out error falls well below the mean predictor's, while the largest of
    # the last hundred batch losses is ten times their median and more.
    facts = outcome.facts
    assert facts["after"] < 0.6 * facts["baseline"] and facts["after"] < 0.5 * facts["before"], {
        k: v for k, v in facts.items() if k != "losses"
    }
    late = sorted(facts["losses"][-100:])
    assert late[-1] > 10 * late[50], late[::10]

    assert_silent(gradflow_server, outcome)

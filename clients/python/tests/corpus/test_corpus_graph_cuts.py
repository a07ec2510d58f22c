"""Corpus: the backward graph cut by a stray `no_grad`, a `.detach()`, or a loss
rebuilt from plain numbers."""

from __future__ import annotations

import torch
from corpus_support import (
    ANY,
    STUCK_WINDOW,
    class_loss,
    expects,
    feature_batches,
    judge,
    moved,
    not_caught,
    quickstart,
    seeded,
    snapshot,
    three_windows,
    train_step,
)
from torch import nn

# grad_stuck_zero's window, three times over.
STEPS = three_windows(STUCK_WINDOW)


class Agent(nn.Module):
    """An observation encoder feeding a policy head (groups `encoder`, `policy`)."""

    def __init__(self, cut: bool) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.policy = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.cut = cut

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.cut:
            with torch.no_grad():  # the bug: the encoder is meant to train
                h = self.encoder(obs)
        else:
            h = self.encoder(obs)
        return self.policy(h)


@seeded
@expects("grad_stuck_zero", "encoder", "backward_not_reached")
def test_observation_encoder_under_no_grad(request, gradflow_server, gradflow_env, seed):
    """The observations are encoded inside `torch.no_grad()` in the training step, so
    the CNN encoder is never updated during pre-training. From the thread's setup
    (URLB's agents): Adam at lr 1e-4, batches of 1024.

    Thread: https://github.com/rll-research/cic/issues/5
    """
    torch.manual_seed(seed)
    model = Agent(cut=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    before = snapshot(model)
    data = feature_batches(16, 4, seed + 1, batch=1024)
    step = train_step(model, optimizer, class_loss, data)
    run_id = quickstart(model, optimizer, step, steps=STEPS)
    changed = moved(before, model)
    assert not [n for n in changed if n.startswith("encoder")] and "policy.2.weight" in changed
    alert = judge(request, gradflow_server, run_id)
    assert alert["evidence"].get("graph_cut"), alert["evidence"]


class DetachedUNet(nn.Module):
    """A small U-Net whose decoder detaches one of its stages (`o_2 = ....detach()`):
    the deeper encoder stages and the decoder above the cut feed the loss only
    through the detached tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Linear(16, 32)
        self.enc2 = nn.Linear(32, 32)
        self.enc3 = nn.Linear(32, 32)
        self.dec3 = nn.Linear(64, 32)
        self.dec2 = nn.Linear(64, 32)
        self.dec1 = nn.Linear(64, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = torch.relu(self.enc1(x))
        x2 = torch.relu(self.enc2(x1))
        x3 = torch.relu(self.enc3(x2))
        o3 = torch.relu(self.dec3(torch.cat([x3, x3], -1)))
        o2 = torch.relu(self.dec2(torch.cat([o3, x2], -1))).detach()  # the bug
        o1 = torch.relu(self.dec1(torch.cat([o2, x1], -1)))
        return self.out(o1)


@seeded
@expects("grad_stuck_zero", ("enc2", "enc3", "dec3", "dec2"), "backward_not_reached")
def test_a_detach_inside_the_decoder(request, gradflow_server, gradflow_env, seed):
    """A `.detach()` on a decoder stage in the forward pass: every layer that reaches
    the loss only through that stage (two encoder stages, two decoder stages) gets no
    gradient and keeps its initial weights. The thread gives no optimizer settings:
    Adam at lr 1e-3.

    Thread: https://github.com/TinaLRJ/Multi-frame-infrared-small-target-detection-DTUM/issues/8
    """
    torch.manual_seed(seed)
    model = DetachedUNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = snapshot(model)
    step = train_step(model, optimizer, class_loss, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=STEPS)
    changed = moved(before, model)
    assert {n.split(".")[0] for n in changed} == {"enc1", "dec1", "out"}, changed
    judge(request, gradflow_server, run_id)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(self.body(obs)), -1)


@seeded
@expects("grad_stuck_zero", ("body", "head"), "backward_not_reached")
def test_policy_loss_rebuilt_from_numpy(request, gradflow_server, gradflow_env, seed):
    """A REINFORCE loss accumulated from `log_probs[...].cpu().detach().numpy()` into
    a tensor that requires grad: `backward()` runs, every layer's `.grad` stays None
    and the weights never change. The thread gives no optimizer settings: Adam at
    lr 1e-3.

    Thread: https://github.com/isayev/ReLeaSE/issues/39
    """
    torch.manual_seed(seed)
    model = Policy()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = snapshot(model)

    def loss_of(model, batch):
        obs, actions = batch
        log_probs = model(obs)
        reward = torch.rand(len(actions), generator=torch.Generator().manual_seed(3)).numpy()
        rl_loss = torch.zeros(1, requires_grad=True)
        picked = log_probs[torch.arange(len(actions)), actions].cpu().detach().numpy()
        rl_loss = rl_loss - torch.from_numpy(picked * reward).sum()  # the bug: detached
        return rl_loss.sum()

    step = train_step(model, optimizer, loss_of, seed=seed)
    run_id = quickstart(model, optimizer, step, steps=STEPS)
    assert not moved(before, model) and model.head.weight.grad is None
    judge(request, gradflow_server, run_id)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@not_caught(
    "missed: the generator still trains on its other loss term; a term that "
    "stopped counting changes only the gradient's direction",
)
@seeded
@expects(ANY, "net", ANY)
def test_adversarial_loss_term_detached_into_a_float(request, gradflow_server, gradflow_env, seed):
    """`loss_adv_g` is detached (`.item()`) and re-assigned before it is added to the
    generator's loss, so the adversarial term never reaches backward: the generator
    trains on the reconstruction term alone. No rule names this yet (the verdict
    declared is any serious alert on the generator). The thread gives no optimizer
    settings: Adam at lr 1e-3.

    Thread: https://github.com/guopengf/FL-MRCM/issues/10
    """
    torch.manual_seed(seed)
    generator = Generator()
    discriminator = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(generator.parameters(), lr=1e-3)
    batches = []
    same = []

    def loss_of(generator, batch):
        x, _ = batch
        batches.append(x)
        fake = generator(x)
        loss_rec = nn.functional.l1_loss(fake, x)
        loss_adv_g = nn.functional.softplus(-discriminator(fake)).mean()
        loss_adv_g = loss_adv_g.item()  # the bug: kept for logging, lost for backward
        return loss_rec + 0.1 * loss_adv_g

    def compare(_):
        x = batches[-1]
        rec = nn.functional.l1_loss(generator(x), x)
        (rec_only,) = torch.autograd.grad(rec, generator.net[0].weight)
        same.append(torch.allclose(generator.net[0].weight.grad, rec_only))

    step = train_step(generator, optimizer, loss_of, after_backward=compare, seed=seed)
    run_id = quickstart(generator, optimizer, step, steps=STEPS)
    assert all(same)  # the adversarial term contributed nothing to any step
    judge(request, gradflow_server, run_id)

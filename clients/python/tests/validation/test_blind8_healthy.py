"""Healthy look-alikes of the eighth set: a PPO agent whose value loss climbs with its
return, a normalizing flow whose NLL goes negative, a segmentation model whose
bootstrapped loss rises as it keeps only the hardest pixels, a DINO student whose loss
does not fall, a WGAN-GP critic far below zero, a classifier under the Hugging Face
Trainer whose loss drops at each epoch, a VRNN whose KL climbs, and a CTC recogniser
under Lightning with gradient accumulation."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Outcome, Run, assert_silent, dry, mean, watch
from .test_blind8_loops import VRNN, binary_sequences

pytestmark = pytest.mark.validation


# -- Unity-Technologies/ml-agents#5440: the value loss rises with the return ------------


def train_ppo(run_id: str, seed: int, rollouts: int = 80) -> Outcome:
    """PPO (clip 0.2, GAE 0.95, discount 0.99, 4 epochs of 2 minibatches a rollout,
    Adam 3e-4) on 16 copies of an episodic task: +1 a step alive, a wrong action ends
    the episode with probability 0.5, 50 steps at most. As the policy improves the
    episodes and the returns grow, and so does the value loss."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9700 + seed)
    w = torch.randn(4, generator=g)
    body = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    model = nn.ModuleDict({"body": body, "pi": nn.Linear(64, 2), "v": nn.Linear(64, 1)})
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    run = watch(run_id, model, optimizer)
    n, horizon = 16, 32
    s = torch.randn(n, 4, generator=g)
    t = torch.zeros(n)
    lengths, value_losses, finished = [], [], []
    for _ in range(rollouts):
        obs, acts, logps, rews, dones, vals = [], [], [], [], [], []
        with torch.no_grad():
            for _ in range(horizon):
                h = model["body"](s)
                dist = torch.distributions.Categorical(logits=model["pi"](h))
                a = dist.sample()
                wrong = a != (s @ w > 0).long()
                t = t + 1
                done = (wrong & (torch.rand(n, generator=g) < 0.5)) | (t >= 50)
                obs.append(s)
                acts.append(a)
                logps.append(dist.log_prob(a))
                vals.append(model["v"](h).squeeze(-1))
                rews.append(torch.ones(n))
                dones.append(done.float())
                finished += t[done].tolist()
                t = torch.where(done, torch.zeros(n), t)
                s = torch.randn(n, 4, generator=g)
            last = model["v"](model["body"](s)).squeeze(-1)
        adv, gae = [], torch.zeros(n)
        for k in reversed(range(horizon)):
            nxt = last if k == horizon - 1 else vals[k + 1]
            delta = rews[k] + 0.99 * nxt * (1 - dones[k]) - vals[k]
            gae = delta + 0.99 * 0.95 * (1 - dones[k]) * gae
            adv.insert(0, gae)
        obs_b, act_b, logp_b = torch.cat(obs), torch.cat(acts), torch.cat(logps)
        adv_b = torch.cat(adv)
        ret_b = adv_b + torch.cat(vals)
        adv_b = (adv_b - adv_b.mean()) / (adv_b.std() + 1e-8)
        for _ in range(4):
            perm = torch.randperm(len(obs_b), generator=g)
            for idx in perm.chunk(2):
                h = model["body"](obs_b[idx])
                dist = torch.distributions.Categorical(logits=model["pi"](h))
                ratio = (dist.log_prob(act_b[idx]) - logp_b[idx]).exp()
                pg = -torch.min(ratio * adv_b[idx], ratio.clamp(0.8, 1.2) * adv_b[idx]).mean()
                vloss = F.mse_loss(model["v"](h).squeeze(-1), ret_b[idx])
                loss = pg + 0.5 * vloss - 0.01 * dist.entropy().mean()
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                run.step(loss)
                value_losses.append(vloss.item())
        lengths.append(mean(finished[-32:]) if finished else 0.0)
    run.close()
    return Outcome(
        {"model": run},
        {
            "length_first": mean(lengths[:5]),
            "length_last": mean(lengths[-5:]),
            "vloss_first": mean(value_losses[:40]),
            "vloss_last": mean(value_losses[-40:]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_value_loss_rises_with_the_return(gradflow_server, gradflow_env, seed):
    """https://github.com/Unity-Technologies/ml-agents/issues/5440"""
    outcome = train_ppo(gradflow_env, seed)

    # The episodes get longer, and the value loss climbs with the returns.
    facts = outcome.facts
    assert facts["length_last"] > 1.5 * facts["length_first"], facts
    assert facts["vloss_last"] > facts["vloss_first"], facts

    assert_silent(gradflow_server, outcome)


# -- vislearn/FrEIA#16: the flow's NLL goes negative -------------------------------------


class Coupling(nn.Module):
    def __init__(self, dim: int, flip: bool) -> None:
        super().__init__()
        self.flip = flip
        self.net = nn.Sequential(nn.Linear(dim // 2, 64), nn.ReLU(), nn.Linear(64, dim))

    def forward(self, x: torch.Tensor):
        a, b = x.chunk(2, -1)
        if self.flip:
            a, b = b, a
        s, t = self.net(a).chunk(2, -1)
        s = torch.tanh(s)
        b = b * s.exp() + t
        out = torch.cat([b, a] if self.flip else [a, b], -1)
        return out, s.sum(-1)


def flow_data(n: int, g: torch.Generator) -> torch.Tensor:
    """Points on two thin curves in 4-d: most of the density is far narrower than the
    unit Gaussian of the latent space."""
    u = torch.rand(n, 1, generator=g) * 6.28
    side = (torch.rand(n, 1, generator=g) < 0.5).float() * 2 - 1
    x = torch.cat([u.cos(), u.sin() * side, 0.3 * u.cos() ** 2, 0.2 * side], -1)
    return x + 0.03 * torch.randn(n, 4, generator=g)


def train_flow(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """An invertible network of six affine couplings (the thread's GLOW-style
    blocks), trained on `mean(z**2) / 2 - mean(log_det) / dim`, Adam 1e-3."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9800 + seed)
    model = nn.ModuleList([Coupling(4, i % 2 == 1) for i in range(6)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)

    def nll(x: torch.Tensor) -> torch.Tensor:
        log_det = torch.zeros(x.shape[0])
        for block in model:
            x, ld = block(x)
            log_det = log_det + ld
        return (x**2).sum(-1).mean() / (2 * 4) - log_det.mean() / 4

    held = flow_data(1000, g)
    with torch.no_grad():
        before = nll(held).item()
    losses = []
    for _ in range(steps):
        loss = nll(flow_data(128, g))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    with torch.no_grad():
        after = nll(held).item()
    return Outcome(
        {"model": run},
        {"first": mean(losses[:10]), "last": mean(losses[-20:]), "before": before, "after": after},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_flow_nll_goes_negative(gradflow_server, gradflow_env, seed):
    """https://github.com/vislearn/FrEIA/issues/16"""
    outcome = train_flow(gradflow_env, seed)

    # The loss starts positive and ends below 0; the held-out NLL fell.
    facts = outcome.facts
    assert facts["first"] > 0 > facts["last"], facts
    assert facts["after"] < facts["before"] - 0.5, facts

    assert_silent(gradflow_server, outcome)


# -- hkchengrex/STCN#28: the bootstrapped CE rises once it keeps the hardest pixels -----


def blob_masks(n: int, g: torch.Generator):
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    c = torch.rand(n, 2, generator=g) * 10 + 3
    r = torch.rand(n, generator=g) * 2 + 2
    mask = (yy - c[:, 0, None, None]) ** 2 + (xx - c[:, 1, None, None]) ** 2 < r[:, None, None] ** 2
    img = mask.float() + 0.6 * torch.randn(n, 16, 16, generator=g)
    return img.unsqueeze(1), mask.long()


def train_stcn(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A small segmentation network (convolutions with batch norm) with STCN's
    bootstrapped cross-entropy: the mean over the top p of pixels by loss, p falling
    from 1 to 0.15 between iterations 100 and 250 (STCN's 20k and 70k, scaled);
    Adam 1e-3."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9900 + seed)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=2, dilation=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 2, 1),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    losses = []
    for it in range(steps):
        x, y = blob_masks(16, g)
        raw = F.cross_entropy(model(x), y, reduction="none").flatten()
        p = 1.0 if it < 100 else max(0.15, 1.0 - 0.85 * (it - 100) / 150)
        loss = raw.topk(int(p * raw.numel())).values.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
        losses.append(loss.item())
    run.close()
    model.eval()
    x, y = blob_masks(256, g)
    with torch.no_grad():
        pred = model(x).argmax(1)
    iou = ((pred == 1) & (y == 1)).sum() / ((pred == 1) | (y == 1)).sum()
    return Outcome(
        {"model": run},
        {
            "at_start": mean(losses[90:100]),
            "peak": max(mean(losses[i : i + 10]) for i in range(100, steps - 10)),
            "iou": iou.item(),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_stcn_bootstrapped_loss_rises(gradflow_server, gradflow_env, seed):
    """https://github.com/hkchengrex/STCN/issues/28"""
    outcome = train_stcn(gradflow_env, seed)

    # The loss climbs above where it was when the bootstrapping began; the masks are
    # good on held-out images.
    facts = outcome.facts
    assert facts["peak"] > 1.2 * facts["at_start"], facts
    assert facts["iou"] > 0.7, facts

    assert_silent(gradflow_server, outcome)


# -- AICONSlab/3DINO#6: the DINO loss does not fall --------------------------------------


def dino_views(n: int, g: torch.Generator, centers: torch.Tensor):
    """Eight clusters in 8 signal dimensions beside 24 nuisance dimensions; two views
    of a sample share its signal and draw their nuisance anew."""
    y = torch.randint(0, 8, (n,), generator=g)
    sig = centers[y] + 0.3 * torch.randn(n, 8, generator=g)

    def view():
        return torch.cat(
            [sig + 0.1 * torch.randn(n, 8, generator=g), 2 * torch.randn(n, 24, generator=g)], -1
        )

    return view(), view(), y


def knn_accuracy(encoder: nn.Module, g: torch.Generator, centers: torch.Tensor) -> float:
    a, _, ya = dino_views(512, g, centers)
    b, _, yb = dino_views(512, g, centers)
    with torch.no_grad():
        fa = F.normalize(encoder(a), dim=-1)
        fb = F.normalize(encoder(b), dim=-1)
    nearest = (fb @ fa.T).argmax(-1)
    return (ya[nearest] == yb).float().mean().item()


def train_dino(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """DINO: a student and an EMA teacher (momentum 0.996), a projection to 64
    prototypes, student temperature 0.1, teacher temperature 0.04 with centering
    (momentum 0.9); AdamW 5e-4 on the student, the teacher moved by hand."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10000 + seed)
    centers = torch.randn(8, 8, generator=g) * 1.5
    backbone = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 64))
    student = nn.Sequential(backbone, nn.GELU(), nn.Linear(64, 64))
    teacher = copy.deepcopy(student).requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=5e-4, weight_decay=0.04)
    run = watch(run_id, student, optimizer)
    before = knn_accuracy(copy.deepcopy(backbone), g, centers)
    center = torch.zeros(64)
    losses = []
    for _ in range(steps):
        v1, v2, _ = dino_views(64, g, centers)
        with torch.no_grad():
            t_out = teacher(torch.cat([v1, v2]))
            t_prob = ((t_out - center) / 0.04).softmax(-1).chunk(2)
            center = 0.9 * center + 0.1 * t_out.mean(0)
        s_logp = (student(torch.cat([v1, v2])) / 0.1).log_softmax(-1).chunk(2)
        loss = (
            -((t_prob[0] * s_logp[1]).sum(-1).mean() + (t_prob[1] * s_logp[0]).sum(-1).mean()) / 2
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for ps, pt in zip(student.parameters(), teacher.parameters()):
                pt.mul_(0.996).add_(0.004 * ps)
        run.step(loss)
        losses.append(loss.item())
    run.close()
    return Outcome(
        {"model": run},
        {
            "first": mean(losses[:20]),
            "last": mean(losses[-20:]),
            "knn_before": before,
            "knn_after": knn_accuracy(backbone, g, centers),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_dino_loss_does_not_fall(gradflow_server, gradflow_env, seed):
    """https://github.com/AICONSlab/3DINO/issues/6"""
    outcome = train_dino(gradflow_env, seed)

    # The loss does not fall by much, while the features' nearest neighbours find
    # the right cluster far more often.
    facts = outcome.facts
    assert facts["last"] > 0.7 * facts["first"], facts
    assert facts["knn_after"] > facts["knn_before"] + 0.15, facts

    assert_silent(gradflow_server, outcome)


# -- handspeaker/gan_practice#1: WGAN-GP's critic loss far below zero --------------------


def ring(n: int, g: torch.Generator) -> torch.Tensor:
    k = torch.randint(0, 8, (n,), generator=g).float() * 6.2832 / 8
    return torch.stack([k.cos(), k.sin()], -1) * 2 + 0.05 * torch.randn(n, 2, generator=g)


def train_wgan_gp(run_id: str, seed: int, g_steps: int = 300, n_critic: int = 5) -> Outcome:
    """WGAN-GP on eight Gaussians on a ring: MLP generator and critic, Adam 1e-4
    betas (0.5, 0.9) each, five critic steps a generator step, gradient penalty 10."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10100 + seed)
    gen = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    critic = nn.Sequential(
        nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-4, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    runs = {
        "generator": watch(f"{run_id}-g", gen, opt_g),
        "critic": watch(f"{run_id}-d", critic, opt_d),
    }

    def distance() -> float:
        with torch.no_grad():
            fake = gen(torch.randn(1000, 2, generator=g))
        k = torch.arange(8).float() * 6.2832 / 8
        modes = torch.stack([k.cos(), k.sin()], -1) * 2
        return torch.cdist(fake, modes).min(-1).values.mean().item()

    before = distance()
    d_losses = []
    for _ in range(g_steps):
        for _ in range(n_critic):
            real = ring(64, g)
            with torch.no_grad():
                fake = gen(torch.randn(64, 2, generator=g))
            eps = torch.rand(64, 1, generator=g)
            mix = (eps * real + (1 - eps) * fake).requires_grad_(True)
            grad = torch.autograd.grad(critic(mix).sum(), mix, create_graph=True)[0]
            gp = ((grad.norm(dim=-1) - 1) ** 2).mean()
            wasserstein = critic(fake).mean() - critic(real).mean()
            d_loss = wasserstein + 10 * gp
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            runs["critic"].step(d_loss)
            d_losses.append(wasserstein.item())
        g_loss = -critic(gen(torch.randn(64, 2, generator=g))).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        runs["generator"].step(g_loss)
    for run in runs.values():
        run.close()
    return Outcome(
        runs,
        {"d_last": mean(d_losses[-100:]), "before": before, "after": distance()},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_wgan_gp_critic_loss_far_below_zero(gradflow_server, gradflow_env, seed):
    """https://github.com/handspeaker/gan_practice/issues/1"""
    outcome = train_wgan_gp(gradflow_env, seed)

    # The critic's Wasserstein term stays below zero; the samples moved onto the
    # ring's modes.
    facts = outcome.facts
    assert facts["d_last"] < 0, facts
    assert facts["after"] < 0.6 * facts["before"], facts

    assert_silent(gradflow_server, outcome)


# -- huggingface/transformers#18730: the loss drops at each epoch under the Trainer -----


class TinyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4)
        )

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


def train_hf_trainer(run_id: str, seed: int, tmp_path) -> Outcome:
    """A classifier trained by `transformers.Trainer` (AdamW 1e-3, linear decay,
    bf16 autocast on the CPU, batches of 16, 10 epochs over 512 examples whose labels
    are partly noisy), watched by gradflow's Trainer callback. The model memorises
    the examples, and the loss drops at the start of each epoch."""
    from transformers import Trainer, TrainingArguments

    from gradflow.integrations.transformers import GradflowCallback

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10200 + seed)
    centers = torch.randn(4, 32, generator=g)

    def sample(n: int, noisy: float):
        y = torch.randint(0, 4, (n,), generator=g)
        x = centers[y] + 1.5 * torch.randn(n, 32, generator=g)
        flip = torch.rand(n, generator=g) < noisy
        return x, torch.where(flip, torch.randint(0, 4, (n,), generator=g), y)

    x, y = sample(512, 0.3)
    train = [{"x": x[i], "labels": y[i]} for i in range(512)]
    losses = []

    class Record(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            out = super().compute_loss(model, inputs, return_outputs, **kwargs)
            losses.append((out[0] if return_outputs else out).item())
            return out

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        num_train_epochs=10,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        bf16=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    if dry():
        warnings.simplefilter("ignore")
    callback = GradflowCallback(run_id=run_id, **({"on_alert": None} if dry() else {}))
    model = TinyClassifier()
    trainer = Record(model=model, args=args, train_dataset=train, callbacks=[callback])
    trainer.train()
    hx, hy = sample(2000, 0.0)
    with torch.no_grad():
        acc = (model(hx)["logits"].argmax(-1) == hy).float().mean().item()
    drops = [
        mean(losses[32 * e - 4 : 32 * e]) - mean(losses[32 * e : 32 * e + 4]) for e in range(1, 10)
    ]
    return Outcome(
        {"model": Run(run_id, steps=trainer.state.global_step)},
        {"accuracy": acc, "drops": drops, "steps": trainer.state.global_step},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_hf_trainer_loss_drops_at_each_epoch(gradflow_server, gradflow_env, seed, tmp_path):
    """https://github.com/huggingface/transformers/issues/18730"""
    outcome = train_hf_trainer(gradflow_env, seed, tmp_path)

    # The loss falls at most epoch boundaries, and the classifier generalises.
    facts = outcome.facts
    assert facts["steps"] == 320, facts
    assert sum(d > 0 for d in facts["drops"]) >= 6, facts
    assert facts["accuracy"] > 0.8, facts

    assert_silent(gradflow_server, outcome)


# -- facebookresearch/improved_vrnn#4: the KL climbs before it falls ---------------------


def train_vrnn_kl(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A VRNN on shifting bit patterns, Adam 1e-3, the gradient clipped to 10 between
    backward and the step. The KL term rises from near 0 as the model starts to use
    its latent variables, while the reconstruction NLL falls."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10300 + seed)
    model = VRNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = watch(run_id, model, optimizer)
    held = binary_sequences(256, g)
    with torch.no_grad():
        nll_before = model(held)[1].item() / 256
    klds = []
    for _ in range(steps):
        x = binary_sequences(32, g)
        kld, nll = model(x)
        loss = (kld + nll) / 32
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        run.step(loss)
        klds.append(kld.item() / 32)
    run.close()
    with torch.no_grad():
        nll_after = model(held)[1].item() / 256
    return Outcome(
        {"model": run},
        {
            "kl_first": mean(klds[:10]),
            "kl_peak": max(klds),
            "nll_before": nll_before,
            "nll_after": nll_after,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_vrnn_kl_climbs(gradflow_server, gradflow_env, seed):
    """https://github.com/facebookresearch/improved_vrnn/issues/4"""
    outcome = train_vrnn_kl(gradflow_env, seed)

    # The KL climbs well above its start; the held-out NLL falls.
    facts = outcome.facts
    assert facts["kl_peak"] > 2 * facts["kl_first"], facts
    assert facts["nll_after"] < 0.7 * facts["nll_before"], facts

    assert_silent(gradflow_server, outcome)


# -- NVIDIA/NeMo#6943: a CTC recogniser under Lightning with gradient accumulation -----


def ctc_batch(n: int, g: torch.Generator, emb: torch.Tensor):
    """Utterances of 4 to 6 tokens from a vocabulary of 5 (blank is 0), each token
    three frames of its own feature vector plus noise."""
    lens = torch.randint(4, 7, (n,), generator=g)
    tokens = torch.randint(1, 6, (n, 6), generator=g)
    frames = torch.zeros(n, 18, 12)
    for i in range(n):
        for j in range(int(lens[i])):
            frames[i, 3 * j : 3 * j + 3] = emb[tokens[i, j]]
    frames = frames + 0.4 * torch.randn(n, 18, 12, generator=g)
    return frames, tokens, lens


def greedy_error(model: nn.Module, g: torch.Generator, emb: torch.Tensor) -> float:
    x, tokens, lens = ctc_batch(200, g, emb)
    with torch.no_grad():
        best = model(x).argmax(-1)
    wrong = 0
    for i in range(200):
        seq = [int(c) for j, c in enumerate(best[i]) if c != 0 and (j == 0 or c != best[i, j - 1])]
        wrong += seq != tokens[i, : int(lens[i])].tolist()
    return wrong / 200


def train_lightning_ctc(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """A convolution and a GRU with a CTC head as a `LightningModule` trained by
    `lightning.Trainer` with `accumulate_grad_batches=4` (AdamW 1e-2, wd 1e-3, 100
    warm-up steps), watched by gradflow's Lightning callback; batches of 8."""
    import lightning

    from gradflow.integrations.lightning import GradflowCallback

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10400 + seed)
    emb = torch.randn(6, 12, generator=g)

    class Recogniser(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(12, 32, 3, padding=1)
            self.rnn = nn.GRU(32, 32, batch_first=True)
            self.out = nn.Linear(32, 6)

        def forward(self, x):
            h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
            return self.out(self.rnn(h)[0])

        def training_step(self, batch, _):
            x, tokens, lens = batch
            logp = self(x).log_softmax(-1).transpose(0, 1)
            return F.ctc_loss(logp, tokens, torch.full((len(x),), 18), lens, zero_infinity=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
            return [opt], [{"scheduler": sched, "interval": "step"}]

    x, tokens, lens = ctc_batch(steps * 4 * 8, g, emb)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, tokens, lens), batch_size=8
    )
    model = Recogniser()
    before = greedy_error(model, g, emb)
    if dry():
        warnings.simplefilter("ignore")
    callback = GradflowCallback(run_id=run_id, **({"on_alert": None} if dry() else {}))
    trainer = lightning.Trainer(
        max_steps=steps,
        accumulate_grad_batches=4,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    model.eval()
    return Outcome(
        {"model": Run(run_id, steps=trainer.global_step)},
        {"before": before, "after": greedy_error(model, g, emb)},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_lightning_ctc_with_gradient_accumulation(gradflow_server, gradflow_env, seed):
    """https://github.com/NVIDIA/NeMo/issues/6943"""
    outcome = train_lightning_ctc(gradflow_env, seed)

    # Most held-out utterances are recognised exactly.
    facts = outcome.facts
    assert facts["before"] > 0.9 and facts["after"] < 0.3, facts

    assert_silent(gradflow_server, outcome)

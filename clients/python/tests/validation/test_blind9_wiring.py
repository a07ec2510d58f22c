"""Failures of the ninth set in how a model, its optimizer or its loop are wired: a
heatmap regressor whose gradients are never zeroed, a tagger whose classifier and CRF
were left out of the optimizer's groups, an image-text model whose whole text side
runs under `torch.no_grad()`, and a small transformer whose bf16 LayerNorm weights
round every update away."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, moved, snapshot, watch

pytestmark = pytest.mark.validation


# -- yastrebksv/TennisCourtDetector#7: a keypoint heatmap loop without zero_grad -----------


class CourtNet(nn.Module):
    """A small encoder-decoder that predicts one heatmap a keypoint, as the court
    detector's `BallTrackerNet` does (conv, batch norm, ReLU; sigmoid heatmaps)."""

    def __init__(self, keypoints: int = 3) -> None:
        super().__init__()

        def block(i: int, o: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

        self.encoder = nn.Sequential(block(1, 16), block(16, 16))
        self.decoder = nn.Sequential(block(16, 16), nn.Conv2d(16, keypoints, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def court_batch(n: int, g: torch.Generator, size: int = 16, keypoints: int = 3):
    """Images with three bright corners at random places, and a Gaussian heatmap for
    each of them."""
    pos = torch.randint(2, size - 2, (n, keypoints, 2), generator=g)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    d2 = (yy - pos[..., 0, None, None]) ** 2 + (xx - pos[..., 1, None, None]) ** 2
    heat = torch.exp(-d2.float() / 2.0)
    image = heat.sum(1, keepdim=True).clamp(max=1) + 0.1 * torch.randn(
        n, 1, size, size, generator=g
    )
    return image, heat


def train_tennis_court(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The repository's `base_trainer.train`: forward, `criterion(sigmoid(out), gt)`,
    `loss.backward()`, `optimizer.step()`, and no `optimizer.zero_grad()` anywhere in
    the loop (Adam 1e-4, MSE on the heatmaps, batches of 8)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9100 + seed)
    model = CourtNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    criterion = nn.MSELoss()
    run = watch(run_id, model, optimizer)
    fresh = carried = 0.0
    for step in range(steps):
        x, heat = court_batch(8, g)
        out = model(x)
        loss = criterion(torch.sigmoid(out), heat)
        if step == steps - 1:
            # This step's own gradient, beside the one the loop's step will use.
            own = torch.autograd.grad(loss, model.decoder[1].weight, retain_graph=True)[0]
            fresh = own.norm().item()
        loss.backward()
        if step == steps - 1:
            carried = model.decoder[1].weight.grad.norm().item()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"fresh": fresh, "carried": carried})


@pytest.mark.parametrize("seed", SEEDS)
def test_tennis_court_gradients_never_zeroed(gradflow_server, gradflow_env, seed):
    """https://github.com/yastrebksv/TennisCourtDetector/issues/7"""
    outcome = train_tennis_court(gradflow_env, seed)

    # The last step's optimizer read the sum of every gradient since the first step:
    # far larger than that step's own gradient.
    facts = outcome.facts
    assert facts["carried"] > 5 * facts["fresh"], facts

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="grads_not_zeroed", causes=("not_zeroed",)),
    )


# -- zjunlp/HVPNeT#5: the classifier and the CRF outside the optimizer's groups ----------


class CRF(nn.Module):
    """A linear-chain CRF: transition scores and the negative log-likelihood of a tag
    sequence by the forward algorithm."""

    def __init__(self, tags: int) -> None:
        super().__init__()
        self.start = nn.Parameter(torch.randn(tags) * 0.1)
        self.transitions = nn.Parameter(torch.randn(tags, tags) * 0.1)

    def nll(self, emissions: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        n, length, _ = emissions.shape
        score = self.start[tags[:, 0]] + emissions[:, 0].gather(1, tags[:, :1])[:, 0]
        alpha = self.start + emissions[:, 0]
        for t in range(1, length):
            score = score + self.transitions[tags[:, t - 1], tags[:, t]]
            score = score + emissions[:, t].gather(1, tags[:, t : t + 1])[:, 0]
            alpha = torch.logsumexp(alpha[:, :, None] + self.transitions, 1) + emissions[:, t]
        return (torch.logsumexp(alpha, 1) - score).mean()


class MultimodalTagger(nn.Module):
    """HVPNeT's shape at small size: a text encoder, visual features turned into a
    prefix the text attends to (here a gated projection), an emission layer `fc` and a
    `crf` on top."""

    def __init__(self, vocab: int = 40, tags: int = 5, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.LSTM(dim, dim // 2, batch_first=True, bidirectional=True)
        self.image2token = nn.Linear(16, dim)
        self.fc = nn.Linear(dim, tags)
        self.crf = CRF(tags)

    def emissions(self, tokens: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.image2token(image)[:, None]
        return self.fc(self.encoder(h)[0])


def tagging_batch(n: int, g: torch.Generator, length: int = 10):
    """Token sequences whose tag follows from the token and the one before it; the
    image says which of two readings a token takes."""
    tokens = torch.randint(0, 40, (n, length), generator=g)
    image = torch.randn(n, 16, generator=g)
    flip = (image[:, 0] > 0).long()[:, None]
    tags = (tokens % 4 + flip * (tokens % 2)) % 5
    tags[:, 1:] = torch.where(tokens[:, :-1] < 5, torch.full_like(tags[:, 1:], 4), tags[:, 1:])
    return tokens, image, tags


def train_hvpnet(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """`modules/train.py` builds the optimizer's groups by name: the text encoder's
    parameters at lr 3e-5 in the repository (1e-3 here, for a model trained from
    scratch), `image2token` at 1e-2 (here 5e-3); the loop that collects the `crf` and
    `fc` parameters never appends them to the list (AdamW)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9200 + seed)
    model = MultimodalTagger()
    text = [p for n, p in model.named_parameters() if n.startswith(("embed", "encoder"))]
    optimizer = torch.optim.AdamW(
        [
            {"params": text, "lr": 1e-3},
            {"params": model.image2token.parameters(), "lr": 5e-3},
        ],
        weight_decay=1e-2,
    )
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    head_grads = []
    for _ in range(steps):
        tokens, image, tags = tagging_batch(16, g)
        loss = model.crf.nll(model.emissions(tokens, image), tags)
        optimizer.zero_grad()
        loss.backward()
        head_grads.append(
            model.fc.weight.grad.norm().item() + model.crf.transitions.grad.norm().item()
        )
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"moved": moved(before, model), "head_grads": head_grads})


@pytest.mark.parametrize("seed", SEEDS)
def test_hvpnet_classifier_and_crf_left_out_of_the_optimizer(gradflow_server, gradflow_env, seed):
    """https://github.com/zjunlp/HVPNeT/issues/5"""
    outcome = train_hvpnet(gradflow_env, seed)

    # fc and the CRF get gradients on every step and never change; the encoder does.
    facts = outcome.facts
    assert min(facts["head_grads"]) > 0, facts["head_grads"][:5]
    assert not any(n.startswith(("fc", "crf")) for n in facts["moved"]), facts["moved"]
    assert "encoder.weight_ih_l0" in facts["moved"] and "image2token.weight" in facts["moved"]

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="param_not_in_optimizer",
            causes=("not_in_optimizer",),
            covers=("fc", "crf"),
        ),
    )


# -- edreisMD/ConVIRT-pytorch#7: the text side's projection under torch.no_grad() ---------


def conv_features() -> nn.Sequential:
    """Two convolutions with batch norm and a global average pool: 32 features from a
    one-channel image (the image encoders of the ConVIRT and SimCLR cases)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


class ConvirtModel(nn.Module):
    """ConVIRT's `ModelCLR` at small size: a CNN image encoder with a two-layer
    projection (`res_l1`, `res_l2`); a text encoder (`bert_model`: embeddings and
    three layers, the first frozen as `freeze_layers` does) whose mean-pooled output
    goes through `bert_l1` and `bert_l2` inside `with torch.no_grad():`."""

    def __init__(self, vocab: int = 64, dim: int = 32, out: int = 16) -> None:
        super().__init__()
        self.res_features = conv_features()
        self.res_l1 = nn.Linear(32, 32)
        self.res_l2 = nn.Linear(32, out)
        self.bert_model = nn.ModuleDict(
            {
                "embeddings": nn.Embedding(vocab, dim),
                "layer": nn.ModuleList(
                    nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(3)
                ),
            }
        )
        for p in self.bert_model["layer"][0].parameters():
            p.requires_grad = False
        self.bert_l1 = nn.Linear(dim, dim)
        self.bert_l2 = nn.Linear(dim, out)

    def image_encoder(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_l2(F.relu(self.res_l1(self.res_features(x))))

    def text_encoder(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.bert_model["embeddings"](tokens)
        for layer in self.bert_model["layer"]:
            h = h + layer(h)
        with torch.no_grad():
            pooled = h.mean(1)
            return self.bert_l2(F.relu(self.bert_l1(pooled)))


def nt_xent(a: torch.Tensor, b: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    logits = F.normalize(a, dim=1) @ F.normalize(b, dim=1).T / temperature
    return F.cross_entropy(logits, torch.arange(len(a)))


def image_text_batch(n: int, g: torch.Generator, classes: int = 8):
    """An image and a report that share one of eight findings."""
    label = torch.randint(0, classes, (n,), generator=g)
    templates = torch.Generator().manual_seed(77)
    pattern = torch.randn(classes, 1, 12, 12, generator=templates)
    image = pattern[label] + 0.8 * torch.randn(n, 1, 12, 12, generator=g)
    words = label[:, None] * 8 + torch.randint(0, 8, (n, 6), generator=g)
    return image, words


def train_convirt(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """`train_clr.py`: Adam over `model.parameters()` (lr 1e-4 and wd 1e-6 in the
    repository's config; 1e-3 here for a model trained from scratch), the NT-Xent loss
    both ways (temperature 0.1, alpha 0.75), batches of 32."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9300 + seed)
    model = ConvirtModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6)
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    losses = []
    for _ in range(steps):
        image, words = image_text_batch(32, g)
        zis, zls = model.image_encoder(image), model.text_encoder(words)
        loss = 0.75 * nt_xent(zis, zls) + 0.25 * nt_xent(zls, zis)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        run.step(loss)
    run.close()
    no_grad = [n for n, p in model.named_parameters() if n.startswith("bert") and p.grad is None]
    return Outcome(
        {"model": run},
        {"moved": moved(before, model), "no_grad": no_grad, "losses": losses},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_convirt_text_side_under_no_grad(gradflow_server, gradflow_env, seed):
    """https://github.com/edreisMD/ConVIRT-pytorch/issues/7"""
    outcome = train_convirt(gradflow_env, seed)

    # Nothing on the text side gets a gradient or moves; the image side trains.
    facts = outcome.facts
    assert not any(n.startswith("bert") for n in facts["moved"]), facts["moved"]
    assert len(facts["no_grad"]) == 11, facts["no_grad"]
    assert "res_l2.weight" in facts["moved"] and "res_features.0.weight" in facts["moved"]

    # The trainable text layers and the text projection: backward never reaches them.
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="grad_stuck_zero",
            causes=("backward_not_reached", "grad_missing"),
            covers=("bert",),
        ),
    )


# -- workofart/ml-by-hand#85: bf16 weights without fp32 master copies --------------------


class TinyGPT(nn.Module):
    """Two pre-norm transformer blocks (LayerNorm, causal self-attention, MLP), a
    final LayerNorm and an output projection."""

    def __init__(self, vocab: int = 24, dim: int = 32, length: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(length, dim)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "ln1": nn.LayerNorm(dim),
                        "attn": nn.MultiheadAttention(dim, 4, batch_first=True),
                        "ln2": nn.LayerNorm(dim),
                        "mlp": nn.Sequential(
                            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
                        ),
                    }
                )
            )
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(length, length, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        mask = self.mask[: x.shape[1], : x.shape[1]]
        for block in self.blocks:
            a = block["ln1"](h)
            h = h + block["attn"](a, a, a, attn_mask=mask, need_weights=False)[0]
            h = h + block["mlp"](block["ln2"](h))
        return self.head(self.ln_f(h))


def pattern_text(n: int, g: torch.Generator, length: int = 17):
    """Sequences that count up by a random stride (mod 24) from a random start."""
    start = torch.randint(0, 24, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % 24


def train_bf16_gpt(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The model is cast to bf16 and trained by AdamW at the PR's lr of 6e-4 with no
    fp32 master copy: each LayerNorm gain starts at 1.0, where bf16's spacing is
    2^-8 below and 2^-7 above, and Adam's step of about the lr rounds back to 1.0."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9400 + seed)
    model = TinyGPT().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.01)
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    losses = []
    for _ in range(steps):
        seq = pattern_text(16, g)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 24), seq[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        run.step(loss)
    run.close()
    gains = [n for n, _ in model.named_parameters() if ("ln" in n) and n.endswith("weight")]
    return Outcome(
        {"model": run},
        {
            "moved": moved(before, model),
            "gains": gains,
            "gain_grads": [model.get_parameter(n).grad.abs().max().item() for n in gains],
            "losses": losses,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_bf16_layernorm_gains_round_back_to_one(gradflow_server, gradflow_env, seed):
    """https://github.com/workofart/ml-by-hand/pull/85"""
    outcome = train_bf16_gpt(gradflow_env, seed)

    # Every LayerNorm gain has a gradient and is still exactly 1.0 after 300 steps;
    # the other weights moved and the loss fell.
    facts = outcome.facts
    assert len(facts["gains"]) == 5 and min(facts["gain_grads"]) > 0, facts["gain_grads"]
    assert not set(facts["gains"]) & facts["moved"], facts["moved"]
    assert "blocks.0.mlp.0.weight" in facts["moved"] and "head.weight" in facts["moved"]
    assert sum(facts["losses"][-20:]) < 0.8 * sum(facts["losses"][:20]), facts["losses"][::30]
    assert math.isfinite(facts["losses"][-1])

    # The norm weights receive gradients and never move: rounding, not a missing
    # optimizer entry. The subject is left to the detector (the gains' names).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_caught(
            gradflow_server,
            outcome,
            Diagnosis(run="model", kind="norm_weight_frozen", causes=("low_precision_underflow",)),
        )


# -- p3i0t/SimCLR-CIFAR10#1: `model.enc.requires_grad = False` freezes nothing ------------


class SimCLRNet(nn.Module):
    """A SimCLR model's shape at small size: a CNN encoder `enc` with batch norm and,
    for linear evaluation, a linear classifier `lin` on its features."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.enc = conv_features()
        self.lin = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.enc(x))


def train_simclr_linear_eval(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """`simclr_lin.py`: `model.enc.requires_grad = False` (a plain attribute on the
    module), then the optimizer takes `[p for p in model.parameters() if
    p.requires_grad]`, which is every parameter: the encoder meant to stay frozen for
    the linear evaluation trains with the classifier (SGD 0.1 momentum 0.9, cosine,
    batches of 32)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(9450 + seed)
    model = SimCLRNet()
    model.enc.requires_grad = False
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.9, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    run = watch(run_id, model, optimizer)
    before = snapshot(model)
    templates = torch.randn(5, 1, 12, 12, generator=torch.Generator().manual_seed(55))
    for _ in range(steps):
        label = torch.randint(0, 5, (32,), generator=g)
        x = templates[label] + torch.randn(32, 1, 12, 12, generator=g)
        loss = F.cross_entropy(model(x), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {"moved": moved(before, model), "in_optimizer": len(parameters)},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_simclr_linear_eval_freeze_flag_on_the_module(gradflow_server, gradflow_env, seed):
    """https://github.com/p3i0t/SimCLR-CIFAR10/issues/1"""
    outcome = train_simclr_linear_eval(gradflow_env, seed)

    # The flag froze nothing: all 10 parameters went to the optimizer and the
    # encoder's weights moved.
    facts = outcome.facts
    assert facts["in_optimizer"] == 10
    assert {"enc.0.weight", "enc.3.weight", "lin.weight"} <= facts["moved"], facts["moved"]

    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="freeze_flag_ignored",
            causes=("freeze_flag_ignored",),
            covers=("enc",),
        ),
    )

"""Metric, self-supervised, semi-supervised and graph-text contrastive learning (the
third set): a semi-supervised expression classifier whose contrastive features are
computed under `no_grad`, so its projection head never trains; and three healthy
runs: a triplet fine-tune whose loss (and gradient) is exactly 0 on most batches, a
DINO run whose loss climbs as its teacher temperature warms up, and a graph-text
grounding whose temperature is a Parameter built anew, and never trained, at every
call on purpose.
"""

from __future__ import annotations

import copy
import math
from typing import Tuple

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, assert_silent, mean, watch

pytestmark = pytest.mark.validation

# How far a sample strays from its class's centre (the centres are 2-sigma apart per
# dimension).
TRIPLET_NOISE = 0.8
DINO_NOISE = 2.0


def clusters(classes: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(classes, dim, generator=torch.Generator().manual_seed(seed)) * 2


def cluster_batch(centres: torch.Tensor, per_class: int, g: torch.Generator, noise: float):
    labels = torch.arange(len(centres)).repeat_interleave(per_class)
    return centres[labels] + noise * torch.randn(len(labels), centres.shape[1], generator=g), labels


def nearest_centroid_accuracy(
    embed, centres: torch.Tensor, g: torch.Generator, noise: float
) -> float:
    x, y = cluster_batch(centres, 32, g, noise)
    with torch.no_grad():
        e = F.normalize(embed(x), dim=1)
    means = F.normalize(torch.stack([e[y == c].mean(0) for c in range(len(centres))]), dim=1)
    return ((e @ means.T).argmax(1) == y).float().mean().item()


# -- KevinMusgrave/pytorch-metric-learning#268: a triplet loss of 0 on most batches -----


def triplet_margin_loss(emb: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """TripletMarginLoss(margin=0.05) over the triplets TripletMarginMiner(margin=0.2)
    mines, on normalised embeddings, with the library's AvgNonZeroReducer: the mean
    of the positive losses, or `sum(emb * 0)` (a zero with a zero gradient) when none."""
    emb = F.normalize(emb, dim=1)
    dist = torch.cdist(emb, emb)
    same = labels[:, None] == labels[None, :]
    anchor_positive = same & ~torch.eye(len(labels), dtype=torch.bool)
    a, p, n = torch.where(anchor_positive[:, :, None] & ~same[:, None, :])
    mined = dist[a, n] - dist[a, p] <= 0.2
    a, p, n = a[mined], p[mined], n[mined]
    losses = F.relu(dist[a, p] - dist[a, n] + 0.05)
    positive = losses > 0
    if positive.sum() == 0:
        return torch.sum(emb * 0), 0
    return losses[positive].mean(), int(positive.sum())


def train_triplet_finetune(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The thread's run: a model trained with a proxy-based loss first (here: a
    normalised softmax over learned class proxies, 300 steps before the watched
    fine-tune), then fine-tuned with TripletMarginLoss and TripletMarginMiner; Adam 1e-4,
    batches of 4 samples per class (MPerClassSampler)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10100 + seed)
    centres = clusters(8, 16, 10200 + seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
    proxies = nn.Parameter(torch.randn(8, 32))
    pretrain = torch.optim.Adam(list(model.parameters()) + [proxies], lr=1e-3)
    for _ in range(300):
        x, y = cluster_batch(centres, 4, g, TRIPLET_NOISE)
        logits = 16 * F.normalize(model(x), dim=1) @ F.normalize(proxies, dim=1).T
        pretrain.zero_grad()
        F.cross_entropy(logits, y).backward()
        pretrain.step()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    run = watch(run_id, model, optimizer)
    zero_steps, active = 0, []
    for _ in range(steps):
        x, y = cluster_batch(centres, 4, g, TRIPLET_NOISE)
        loss, positives = triplet_margin_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        zero_steps += int(positives == 0)
        active.append(positives)
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "zero_steps": zero_steps,
            "active_first": mean(active[:100]),
            "active_last": mean(active[-100:]),
            "accuracy": nearest_centroid_accuracy(model, centres, g, TRIPLET_NOISE),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_triplet_finetune_loss_is_zero_on_most_batches(gradflow_server, gradflow_env, seed):
    """https://github.com/KevinMusgrave/pytorch-metric-learning/issues/268"""
    outcome = train_triplet_finetune(gradflow_env, seed)

    # Most batches have no triplet inside the margin: loss and gradient exactly 0. The
    # other batches still train: fewer triplets violate the margin by the end, and the
    # embedding separates the classes.
    facts = outcome.facts
    assert facts["zero_steps"] > 150, facts
    assert facts["active_last"] < facts["active_first"], facts
    assert facts["accuracy"] > 0.9, facts

    # Healthy: a margin loss that is satisfied has nothing to teach.
    assert_silent(gradflow_server, outcome)


# -- lightly-ai/lightly-train#442: the DINO loss climbs with its schedules --------------


class DINO(nn.Module):
    """lightly's DINO example: a student backbone and head, their teacher copies with
    `requires_grad` off (moved by EMA), one optimizer over `model.parameters()`."""

    def __init__(self, dim: int = 16, out_dim: int = 64) -> None:
        super().__init__()
        self.student_backbone = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, 32))
        self.student_head = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, out_dim))
        self.teacher_backbone = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, 32))
        self.teacher_head = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, out_dim))
        self.teacher_backbone.load_state_dict(self.student_backbone.state_dict())
        self.teacher_head.load_state_dict(self.student_head.state_dict())
        for p in [*self.teacher_backbone.parameters(), *self.teacher_head.parameters()]:
            p.requires_grad = False

    def student(self, x: torch.Tensor) -> torch.Tensor:
        return self.student_head(self.student_backbone(x))

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        return self.teacher_head(self.teacher_backbone(x))


def train_dino(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """DINO's loss with its schedules: the teacher temperature warms up from 0.04 to
    0.07 over the first 30% of steps, the student's is 0.1, the center's momentum 0.9,
    the EMA momentum follows a cosine from 0.996 to 1; Adam 1e-3 on all parameters.
    The views are the sample with noise and a random half of its features dropped."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10300 + seed)
    centres = clusters(8, 16, 10400 + seed)
    model = DINO()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    center = torch.zeros(1, 64)
    warmup = int(0.3 * steps)
    teacher_temps = np.concatenate([np.linspace(0.04, 0.07, warmup), np.full(steps - warmup, 0.07)])
    initial_student = copy.deepcopy(nn.ModuleList([model.student_backbone, model.student_head]))
    run = watch(run_id, model, optimizer)
    losses = []

    def view(x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape, generator=g) > 0.5).float()
        return x * keep + 0.3 * torch.randn(x.shape, generator=g)

    def dino_loss(student, v1, v2, t1, t2, temp: float) -> torch.Tensor:
        loss = 0.0
        for t, s in ((t1, student(v2)), (t2, student(v1))):
            targets = F.softmax((t - center) / temp, dim=-1)
            loss = loss + torch.sum(-targets * F.log_softmax(s / 0.1, dim=-1), dim=-1).mean()
        return loss / 2

    for step in range(steps):
        x, _ = cluster_batch(centres, 8, g, DINO_NOISE)
        v1, v2 = view(x), view(x)
        with torch.no_grad():
            t1, t2 = model.teacher(v1), model.teacher(v2)
        loss = dino_loss(model.student, v1, v2, t1, t2, float(teacher_temps[step]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        momentum = 1 - (1 - 0.996) * (math.cos(math.pi * step / steps) + 1) / 2
        with torch.no_grad():
            for student, teacher in (
                (model.student_backbone, model.teacher_backbone),
                (model.student_head, model.teacher_head),
            ):
                for ps, pt in zip(student.parameters(), teacher.parameters()):
                    pt.mul_(momentum).add_((1 - momentum) * ps)
            center = 0.9 * center + 0.1 * torch.cat([t1, t2]).mean(0, keepdim=True)
        losses.append(loss.item())
        run.step(loss)
    run.close()
    # The same final targets, matched by the trained student and by the one it started
    # as.
    x, _ = cluster_batch(centres, 64, g, DINO_NOISE)
    v1, v2 = view(x), view(x)
    with torch.no_grad():
        t1, t2 = model.teacher(v1), model.teacher(v2)
        trained = dino_loss(model.student, v1, v2, t1, t2, 0.07).item()
        untrained = dino_loss(
            lambda v: initial_student[1](initial_student[0](v)), v1, v2, t1, t2, 0.07
        ).item()
    return Outcome(
        {"model": run},
        {
            "loss_low": min(mean(losses[i : i + 10]) for i in range(0, warmup, 10)),
            "loss_last": mean(losses[-20:]),
            "final_targets_trained": trained,
            "final_targets_untrained": untrained,
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_dino_loss_climbs_as_the_teacher_warms(gradflow_server, gradflow_env, seed):
    """https://github.com/lightly-ai/lightly-train/issues/442"""
    outcome = train_dino(gradflow_env, seed)

    # The loss ends well above its lowest, while the student matches the teacher's final
    # targets far better than the student it started as.
    facts = outcome.facts
    assert facts["loss_last"] > 1.1 * facts["loss_low"], facts
    assert facts["final_targets_trained"] < facts["final_targets_untrained"] - 0.1, facts

    # Healthy: the rise is the temperature schedule's; the teacher is frozen and moved
    # by EMA on purpose.
    assert_silent(gradflow_server, outcome)


# -- HKUDS/GraphGPT#31: a temperature built as a Parameter at every call, kept fixed ---


def cal_cl_loss(
    s_features: torch.Tensor, t_features: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The repository's function, as the thread quotes it: the logit scale is a new
    `nn.Parameter` at every call, never handed to an optimizer; the maintainers keep
    the temperature at 0.07 this way on purpose."""
    logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07)).exp()
    logits = logit_scale * s_features @ t_features.t()
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class GraphTextModel(nn.Module):
    """A two-layer GCN over the whole graph for the nodes, a bag-of-words encoder for
    their texts, both projected and normalised."""

    def __init__(self, features: int, vocab: int) -> None:
        super().__init__()
        self.gcn1 = nn.Linear(features, 64)
        self.gcn2 = nn.Linear(64, 32)
        self.text = nn.Sequential(nn.EmbeddingBag(vocab, 64), nn.ReLU(), nn.Linear(64, 32))

    def nodes(self, adjacency: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(adjacency @ self.gcn1(x))
        return F.normalize(adjacency @ self.gcn2(h), dim=1)

    def texts(self, words: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(words), dim=1)


def text_graph(seed: int):
    """128 nodes in 8 communities; a node's features are noisy community signals and
    its text names its community's words and its own."""
    g = torch.Generator().manual_seed(seed)
    n, communities = 128, 8
    community = torch.arange(n) % communities
    edges = (
        torch.rand(n, n, generator=g)
        < torch.where(community[:, None] == community[None, :], 0.2, 0.01)
    ).float()
    edges = ((edges + edges.T) > 0).float() + torch.eye(n)
    degree = edges.sum(1)
    adjacency = edges / torch.sqrt(degree[:, None] * degree[None, :])
    x = F.one_hot(community, communities).float() @ torch.randn(communities, 16, generator=g)
    x = x + torch.randn(n, 16, generator=g)
    words = torch.stack(
        [
            torch.cat(
                [
                    community[i : i + 1] * 4 + torch.randint(0, 4, (3,), generator=g),
                    32 + torch.tensor([i]),
                ]
            )
            for i in range(n)
        ]
    )
    return adjacency, x, words


def retrieval_accuracy(model: GraphTextModel, graph) -> float:
    adjacency, x, words = graph
    with torch.no_grad():
        sims = model.nodes(adjacency, x) @ model.texts(words).T
    return (sims.argmax(1) == torch.arange(len(x))).float().mean().item()


def train_text_graph_grounding(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Text-graph grounding as the repository trains it: a batch of 32 nodes, their
    GCN embeddings against their texts' through `cal_cl_loss`; Adam 1e-3."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10500 + seed)
    graph = text_graph(10600 + seed)
    adjacency, x, words = graph
    model = GraphTextModel(16, 32 + len(x))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = retrieval_accuracy(model, graph)
    run = watch(run_id, model, optimizer)
    for _ in range(steps):
        batch = torch.randperm(len(x), generator=g)[:32]
        loss = cal_cl_loss(
            model.nodes(adjacency, x)[batch], model.texts(words[batch]), torch.arange(32)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"before": before, "after": retrieval_accuracy(model, graph)})


@pytest.mark.parametrize("seed", SEEDS)
def test_graph_text_grounding_with_a_fixed_temperature(gradflow_server, gradflow_env, seed):
    """https://github.com/HKUDS/GraphGPT/issues/31"""
    outcome = train_text_graph_grounding(gradflow_env, seed)

    # Nodes find their own texts among all 128 far more often than at the start.
    facts = outcome.facts
    assert facts["after"] > facts["before"] + 0.3, facts

    # Healthy: the temperature Parameter is outside the model and fixed on purpose;
    # the model itself trains.
    assert_silent(gradflow_server, outcome)


# -- hangyu94/Ada-CM#8: the contrastive features are computed under no_grad -----------


class ExpressionNet(nn.Module):
    """A backbone with a 7-way expression classifier and a projection head for the
    contrastive term; `forward` returns both, as the repository's model does."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.classifier = nn.Linear(64, 7)
        self.projection = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.backbone(x)
        return self.classifier(h), F.normalize(self.projection(h), dim=1)


def supcon_loss(features: torch.Tensor, temperature: float = 0.07) -> torch.Tensor:
    """SupConLoss without labels (SimCLR's): features (n, 2 views, d)."""
    n = features.shape[0]
    z = torch.cat(features.unbind(1))
    logits = z @ z.T / temperature
    logits = logits - torch.eye(2 * n) * 1e9
    positives = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(logits, positives)


def train_ada_cm(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """Ada-CM's step as the thread found it uploaded: the two weak views of the
    unlabeled batch go through the model under `torch.no_grad()`; their pseudo-labels
    (confidence at least 0.8) drive a consistency CE on the strong view, and the
    unconfident samples' features a SupCon term (weight 0.1); labeled CE weight 0.5;
    Adam 2e-3 and the repository's WeightEMA (alpha 0.999, with its weight decay)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(10700 + seed)
    centres = clusters(7, 16, 10800 + seed)
    model = ExpressionNet()
    ema_model = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    ema_params = list(ema_model.state_dict().values())
    params = list(model.state_dict().values())
    run = watch(run_id, model, optimizer)
    head_grads, supcon_terms = 0, 0
    before = nearest_centroid_accuracy(lambda x: model(x)[0], centres, g, 1.5)

    def augment(x: torch.Tensor, strength: float) -> torch.Tensor:
        return x + strength * torch.randn(x.shape, generator=g)

    for _ in range(steps):
        inputs_x, targets_x = cluster_batch(centres, 2, g, 1.5)
        unlabeled, _ = cluster_batch(centres, 4, g, 1.5)
        with torch.no_grad():
            outputs_u, feature_u = model(augment(unlabeled, 0.3))
            outputs_u2, feature_u2 = model(augment(unlabeled, 0.3))
        p = (torch.softmax(outputs_u, dim=1) + torch.softmax(outputs_u2, dim=1)) / 2
        max_probs, max_idx = torch.max(p, dim=1)
        mask = max_probs.ge(0.8).float()
        unsure = torch.where(mask == 0)[0]
        output_x, _ = model(inputs_x)
        lx = F.cross_entropy(output_x, targets_x)
        if len(unsure) == 0:
            ls = torch.tensor(0.0)
        else:
            ls = supcon_loss(torch.stack([feature_u[unsure], feature_u2[unsure]], 1))
            supcon_terms += 1
        output_strong, _ = model(augment(unlabeled, 0.8))
        lu = (F.cross_entropy(output_strong, max_idx, reduction="none") * mask).mean()
        loss = lx * 0.5 + lu + ls * 0.1
        optimizer.zero_grad()
        loss.backward()
        head_grads += int(any(p.grad is not None for p in model.projection.parameters()))
        optimizer.step()
        with torch.no_grad():  # WeightEMA.step()
            for param, ema_param in zip(params, ema_params):
                ema_param.mul_(0.999).add_(param * 0.001)
                param.mul_(1 - 0.02 * 2e-3)
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "head_grad_steps": head_grads,
            "supcon_steps": supcon_terms,
            "before": before,
            "after": nearest_centroid_accuracy(lambda x: model(x)[0], centres, g, 1.5),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_ada_cm_contrastive_term_never_reaches_the_head(gradflow_server, gradflow_env, seed):
    """https://github.com/hangyu94/Ada-CM/issues/8"""
    outcome = train_ada_cm(gradflow_env, seed)

    # The contrastive term is in the loss on many steps (while some pseudo-labels are
    # unsure) and is a constant: the projection head, which only it uses, never gets
    # a gradient. The classifier trains.
    facts = outcome.facts
    assert facts["supcon_steps"] > 50, facts
    assert facts["head_grad_steps"] == 0, facts
    assert facts["after"] > facts["before"] + 0.2, facts

    # The correct verdict: backward never reaches the projection head (PROTOCOL:
    # grad_stuck_zero, cause backward_not_reached or grad_missing, on `projection`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="grad_stuck_zero",
            causes=("backward_not_reached", "grad_missing"),
            covers=("projection",),
        ),
    )

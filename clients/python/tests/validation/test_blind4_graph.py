"""Graph nets (the fourth set): a graph classifier whose graph convolutions sit in a
plain Python list, so that only its readout MLP is ever trained.

The graphs are small (12 nodes, dense adjacency): class 1 graphs are two dense
communities joined by one edge, class 0 graphs are random with the same number of
edges; every node's feature is its degree and noise, so the class is in the
structure the convolutions should learn to read.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from .support import SEEDS, Diagnosis, Outcome, assert_caught, snapshot, watch

pytestmark = pytest.mark.validation

NODES = 12


def graph_batch(size: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adjacency (with self-loops, row-normalised as a GCN's), node features and labels."""
    labels = torch.randint(0, 2, (size,), generator=g)
    adjacency = torch.zeros(size, NODES, NODES)
    half = NODES // 2
    for i in range(size):
        if labels[i] == 1:
            block = (torch.rand(half, half, generator=g) < 0.7).float()
            adjacency[i, :half, :half] = block
            adjacency[i, half:, half:] = (torch.rand(half, half, generator=g) < 0.7).float()
            adjacency[i, 0, half] = 1.0
        else:
            edges = int(0.35 * NODES * NODES)
            flat = torch.randperm(NODES * NODES, generator=g)[:edges]
            adjacency[i].view(-1)[flat] = 1.0
    adjacency = ((adjacency + adjacency.transpose(1, 2)) > 0).float()
    adjacency = adjacency + torch.eye(NODES)
    degree = adjacency.sum(-1, keepdim=True)
    features = torch.cat([degree / NODES, 0.1 * torch.randn(size, NODES, 3, generator=g)], -1)
    return adjacency / degree, features, labels


class GraphConv(nn.Module):
    """A dense GCN layer: aggregate the neighbours, then a linear map."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.linear = nn.Linear(cin, cout)

    def forward(self, adjacency: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.linear(adjacency @ x)


class GCNClassifier(nn.Module):
    """The repository's `GCN` for graph classification as the pull request found it:
    `n_agg_layer` graph convolutions appended to `self.layers = []`, an average
    readout, two fully connected layers. The list hides the convolutions from
    `parameters()`: the optimizer never sees them."""

    def __init__(self, cin: int = 4, hidden: int = 32, n_agg_layer: int = 2) -> None:
        super().__init__()
        self.layers = []
        for i in range(n_agg_layer):
            self.layers.append(GraphConv(cin if i == 0 else hidden, hidden))
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, adjacency: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(adjacency, x))
        x = x.mean(dim=1)  # readout 'avg'
        return self.fc2(F.relu(self.fc1(x)))


def train_gcn_graph_classifier(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The repository's loop in small: Adam over `model.parameters()` (lr 1e-3 as its
    default), cross-entropy, batch 32 graphs."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(4500 + seed)
    model = GCNClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    run = watch(run_id, model, optimizer)
    convs = [layer.linear.weight for layer in model.layers]
    before_convs = [w.detach().clone() for w in convs]
    before = snapshot(model)
    for _ in range(steps):
        adjacency, features, labels = graph_batch(32, g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(adjacency, features), labels)
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome(
        {"model": run},
        {
            "registered": sorted(before),
            "convs_moved": any(not torch.equal(w, b) for w, b in zip(convs, before_convs)),
            "convs_got_grad": all(w.grad is not None and w.grad.abs().sum() > 0 for w in convs),
            "fc_moved": not torch.equal(model.fc1.weight.detach(), before["fc1.weight"]),
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_gcn_layers_kept_in_a_python_list(gradflow_server, gradflow_env, seed):
    """https://github.com/qbxlvnf11/graph-neural-networks-for-graph-classification/pull/3"""
    outcome = train_gcn_graph_classifier(gradflow_env, seed)

    # The model's parameters are the two fully connected layers alone; the graph
    # convolutions got gradients on every step and never changed.
    facts = outcome.facts
    assert facts["registered"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], facts
    assert facts["convs_got_grad"] and not facts["convs_moved"], facts
    assert facts["fc_moved"], facts

    # The correct verdict: modules kept in a plain list attribute of the model, whose
    # parameters are not the model's (PROTOCOL: modules_not_registered, subject `run`
    # for the model itself).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(
            run="model",
            kind="modules_not_registered",
            causes=("modules_not_registered",),
            covers=("run",),
        ),
    )

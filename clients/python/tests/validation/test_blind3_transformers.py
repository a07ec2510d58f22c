"""Transformers fine-tuning (the third set): a DistilBERT document regression head
whose squeezed predictions meet unsqueezed labels in an element-wise MSE, so every
prediction is compared with every label of the batch.

The model is a tiny DistilBERT with random weights; a document's target is how often
two marker tokens occur in it, standardised.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .support import SEEDS, Diagnosis, Outcome, assert_caught, watch

pytestmark = pytest.mark.validation

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, MARKERS = 64, 16, (5, 9)


def documents(size: int, g: torch.Generator):
    tokens = torch.randint(1, VOCAB, (size, LENGTH), generator=g)
    counts = sum((tokens == m).sum(1) for m in MARKERS).float()
    # Standardised as FARM's processor scales regression labels; shape (size, 1), as
    # the processor builds its label tensors.
    return tokens, ((counts - 0.5) / 0.7).unsqueeze(1)


class DocRegression(nn.Module):
    """FARM's AdaptiveModel in small: a language model, the first token's vector and a
    RegressionHead (a feed-forward [dim, 1]) whose logits are squeezed, as FARM #230
    found they were."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            hidden_dim=64,
            n_layers=2,
            n_heads=2,
            max_position_embeddings=LENGTH,
        )
        self.language_model = transformers.DistilBertModel(config)
        self.head = nn.Linear(32, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.language_model(input_ids=tokens).last_hidden_state[:, 0]
        return self.head(hidden).squeeze(-1)


def r_squared(model: DocRegression, g: torch.Generator) -> float:
    tokens, labels = documents(512, g)
    model.eval()
    with torch.no_grad():
        predicted = model(tokens)
    model.train()
    labels = labels.squeeze(1)
    return 1 - ((predicted - labels) ** 2).mean().item() / labels.var().item()


def train_farm_regression(run_id: str, seed: int, steps: int = 300) -> Outcome:
    """The thread's run: distilBERT with `RegressionHead([768, 1])`, batch 32, AdamW
    (lr 1e-3 for the tiny random model). The head's loss is
    `MSELoss(reduction="none")(logits, label_ids)` with logits (32,) and labels (32, 1):
    a (32, 32) matrix, averaged into the step's loss."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5100 + seed)
    model = DocRegression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fct = nn.MSELoss(reduction="none")
    run = watch(run_id, model, optimizer)
    shapes = set()
    for _ in range(steps):
        tokens, labels = documents(32, g)
        per_sample = loss_fct(model(tokens), labels)
        shapes.add(tuple(per_sample.shape))
        loss = per_sample.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    run.close()
    return Outcome({"model": run}, {"loss_shapes": shapes, "r_squared": r_squared(model, g)})


@pytest.mark.parametrize("seed", SEEDS)
def test_farm_regression_head_loss_broadcasts(gradflow_server, gradflow_env, seed):
    """https://github.com/deepset-ai/FARM/issues/229"""
    outcome = train_farm_regression(gradflow_env, seed)

    # Every step's loss compared each of the 32 predictions with all 32 labels; the
    # best the head can do is the batch's mean, so it explains none of the targets.
    facts = outcome.facts
    assert facts["loss_shapes"] == {(32, 32)}, facts
    assert facts["r_squared"] < 0.1, facts

    # The correct verdict: an element-wise loss whose prediction and target broadcast
    # into 32 pairs per prediction (PROTOCOL: loss_broadcasts, subject `loss`).
    assert_caught(
        gradflow_server,
        outcome,
        Diagnosis(run="model", kind="loss_broadcasts", causes=("loss_broadcasts",)),
    )

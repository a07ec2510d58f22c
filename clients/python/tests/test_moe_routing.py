"""`moe_router_collapse` and `moe_load_imbalance` on a CPU recipe through the real
client, beside the healthy twin.

The tiny GPT of test_instabilities.py with its MLPs replaced by top-1 mixtures of 8
experts (a ``gate`` and ``experts``, as transformers' sparse MoE blocks have, so the
client finds the routers without being told). A router whose bias starts large and
no load-balancing loss sends nearly every token to one expert from the first steps;
the default initialisation with Switch Transformer's balancing loss (1e-2) keeps
the load spread.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from conftest import new_run_id
from test_instabilities import VOCAB, WIDTH, TinyGPT, bigram_batches
from torch import nn

import gradflow

EXPERTS = 8
STEPS = 150


class SparseMoE(nn.Module):
    """Top-1 routing over 8 small MLPs; ``aux`` is the step's Switch balancing loss."""

    def __init__(self, router_bias_std: float) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, EXPERTS)
        if router_bias_std:
            nn.init.normal_(self.gate.bias, std=router_bias_std)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(EXPERTS)
        )
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = self.gate(flat).softmax(-1)
        weight, chosen = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            mask = chosen == e
            if mask.any():
                out[mask] = weight[mask, None] * expert(flat[mask])
        share = torch.bincount(chosen, minlength=EXPERTS).float() / chosen.numel()
        self.aux = EXPERTS * (share * probs.mean(0)).sum()
        return out.reshape(b, t, d)


def train(server: Any, router_bias_std: float, balance: float) -> str:
    torch.set_num_threads(1)
    model = TinyGPT(mlp=lambda: SparseMoE(router_bias_std))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id("moe"),
        on_alert=None,
        signals={"moe": 1},
    )
    for _, tokens, targets in bigram_batches(STEPS):
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        aux = sum(block.mlp.aux for block in model.layers)
        optimizer.zero_grad()
        (loss + balance * aux).backward()
        optimizer.step()
        gf.step(loss)
    gf.close()
    return gf.run_id


def moe_alerts(server: Any, run_id: str) -> List[Any]:
    return [a for a in server.serious(run_id) if a["kind"].startswith("moe_")]


def test_a_router_that_sends_every_token_to_one_expert_is_a_collapse(gradflow_server):
    run_id = train(gradflow_server, router_bias_std=3.0, balance=0.0)
    for layer in ("layers.0.mlp", "layers.1.mlp"):
        alert = gradflow_server.wait_for_alert(run_id, "moe_router_collapse", layer)
        assert alert["severity"] == "critical"
        assert alert["evidence"]["top_share"] > 0.9
        assert alert["evidence"]["idle_experts"] >= 4
        assert alert["first_step"] <= 10
    shares = gradflow_server.series(run_id, "moe_top_share", "layers.0.mlp")
    assert len(shares) == STEPS


@pytest.mark.parametrize("router_bias_std", [0.0])
def test_balanced_routing_stays_silent(gradflow_server, router_bias_std):
    run_id = train(gradflow_server, router_bias_std=router_bias_std, balance=1e-2)
    shares = gradflow_server.series(run_id, "moe_top_share", "layers.1.mlp")
    assert len(shares) == STEPS and max(v for _, v in shares) < 0.5
    assert gradflow_server.serious(run_id) == []

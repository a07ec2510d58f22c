"""`output_logit_drift` on a CPU recipe through the real client, beside its healthy
twins: the tiny GPT of test_instabilities.py with QK-LayerNorm (so that attention
holds), AdamW at lr 1e-1, no weight decay. Without the final norm before the head,
log Z leaves its start (5.9) for ~225 within 20 steps while the loss goes from 5.9 to
~300, in f32 and under bf16 autocast alike; with the final norm at the same lr it
rises to ~17 as the loss falls to ~1, and without it at lr 3e-2 to ~12 (loss ~1).
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from conftest import new_run_id
from test_instabilities import VOCAB, TinyGPT, bigram_batches
from torch import nn

import gradflow

STEPS = 120


def train(server: Any, *, lr: float, final_norm: bool, autocast: bool = False) -> str:
    torch.set_num_threads(1)
    model = TinyGPT(qk_norm=True)
    if not final_norm:
        model.ln_f = nn.Identity()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gf = gradflow.watch(
        model,
        optimizer,
        server=server.url,
        run_id=new_run_id("logitdrift"),
        on_alert=None,
        signals={"output_logits": 1},
    )
    for _, tokens, targets in bigram_batches(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gf.step(loss)
    gf.close()
    return gf.run_id


def drift_alerts(server: Any, run_id: str) -> List[Any]:
    return [a for a in server.alerts(run_id) if a["kind"] == "output_logit_drift"]


@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16-autocast"])
def test_log_z_running_away_without_a_final_norm_is_caught(gradflow_server, autocast):
    run_id = train(gradflow_server, lr=1e-1, final_norm=False, autocast=autocast)
    alert = gradflow_server.wait_for_alert(run_id, "output_logit_drift")
    assert (alert["severity"], alert["subject"]) == ("warning", "logits")
    evidence = alert["evidence"]
    assert evidence["cause"] == "logz_drift"
    assert evidence["drift"] >= 16 and evidence["logz"] > evidence["early_logz"]
    assert evidence["loss"] > evidence["lowest_loss"]
    assert alert["first_step"] < 40
    # Under autocast the text says how coarsely bf16 holds logits at that level.
    assert (evidence["compute_dtype"] == "bf16") == autocast
    if autocast:
        assert evidence["logit_spacing"] >= 0.5
        assert "bf16 autocast" in alert["detail"]


@pytest.mark.parametrize(("lr", "final_norm"), [(1e-1, True), (3e-2, False)])
def test_log_z_that_moves_while_the_model_learns_stays_silent(gradflow_server, lr, final_norm):
    run_id = train(gradflow_server, lr=lr, final_norm=final_norm)
    logz = gradflow_server.series(run_id, "output_logz_mean")
    assert len(logz) == STEPS
    assert drift_alerts(gradflow_server, run_id) == []
    assert gradflow_server.serious(run_id) == []

"""fp16 autocast with no loss scaler: backward flushes every gradient below fp16's
smallest value (6e-8) to zero, with no error and no NaN; the loss just stops moving
(engichang1467/Open-Rig3R#35: ``autocast`` defaulting to fp16 with no GradScaler,
a loss mixing large and small bounded terms). The client sends the forward's
autocast dtype (``precision.compute_dtype``) and whether a scaler is watched, and a
``grad_stuck_zero`` that backward reached names the underflow with its fix instead
of masks or dead units.

The look-alikes are the same model, data and loss trained under bf16 autocast, and
under fp16 autocast with a GradScaler: both train, and stay silent."""

from __future__ import annotations

from typing import Any, List, Optional

import pytest
import torch
from conftest import new_run_id
from torch import nn

import gradflow

STEPS = 60  # past stuck_zero_steps (50)
# The loss's weight: a small term, the kind that underflows first. Over a batch of
# 1024 each sample's gradient is below fp16's range while their sum, in f32 or bf16,
# is around 1e-5: Adam trains on it, far above its eps.
WEIGHT = 1e-4
BATCH = 1024

needs_cpu_fp16 = pytest.mark.skipif(
    not hasattr(torch.amp, "GradScaler"), reason="torch without torch.amp.GradScaler"
)


def train(server, dtype: torch.dtype, scaler: Optional[Any]) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    gf = gradflow.watch(
        model, optimizer, scaler=scaler, server=server.url, run_id=new_run_id("amp")
    )
    g = torch.Generator().manual_seed(1)
    losses: List[float] = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 16, generator=g)
        target = x[:, :1] * 0.1
        with torch.autocast("cpu", dtype=dtype):
            loss = ((model(x).float() - target) ** 2).mean() * WEIGHT
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        gf.step(loss=loss)
        losses.append(loss.item())
    gf.close()
    server.wait_for_steps(gf.run_id, STEPS)
    return gf.run_id, losses


@needs_cpu_fp16
def test_fp16_autocast_without_a_scaler_names_the_underflow(gradflow_server):
    run_id, _ = train(gradflow_server, torch.float16, None)
    assert gradflow_server.run(run_id)["precision"]["compute_dtype"] == "f16"
    serious = gradflow_server.serious(run_id)
    # The two hidden layers get exactly 0 (their gradients pass one more fp16 product
    # and underflow); the head's survive, so the loss still falls a little.
    assert sorted(a["subject"] for a in serious) == ["0", "2"], serious
    for alert in serious:
        assert alert["kind"] == "grad_stuck_zero", serious
        assert alert["evidence"]["cause"] == "fp16_without_scaler", alert
        assert "GradScaler" in alert["fix"] and "bfloat16" in alert["fix"]


@needs_cpu_fp16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_or_a_scaler_trains_and_stays_silent(gradflow_server, dtype):
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    run_id, losses = train(gradflow_server, dtype, scaler)
    assert losses[-1] < 0.5 * losses[0], "training measurably progressed"
    assert gradflow_server.serious(run_id) == []

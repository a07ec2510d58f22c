"""`activation_norm_growth` (info) on a CPU recipe through the real client, beside
its healthy twin: the tiny GPT of test_instabilities.py without weight decay. At lr
3e-2 both blocks' output RMS grows 2.5–2.9× every 200 steps from step 200 on (1.5
to 40 by step 500) while the loss improves by under a tenth; at lr 3e-3 it grows
1.6× from step 100 to 300 while the loss falls by a fifth.
"""

from __future__ import annotations

from typing import Any, List

from test_instabilities import bigram_batches, run_gpt

GROWING_STEPS = 500
HEALTHY_STEPS = 300


def train(server: Any, lr: float, steps: int) -> str:
    return run_gpt(
        server,
        ((tokens, targets) for _, tokens, targets in bigram_batches(steps)),
        prefix="actgrowth",
        signals={"activations": 1},
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )


def growth_alerts(server: Any, run_id: str) -> List[Any]:
    return [a for a in server.alerts(run_id) if a["kind"] == "activation_norm_growth"]


def test_activations_that_grow_while_the_loss_is_flat_are_said(gradflow_server):
    run_id = train(gradflow_server, 3e-2, GROWING_STEPS)
    alert = gradflow_server.wait_for_alert(run_id, "activation_norm_growth")
    assert alert["severity"] == "info"
    assert alert["evidence"]["module"].startswith("layers.")
    assert alert["evidence"]["ratio"] >= 2
    assert alert["first_step"] >= 200


def test_growth_that_the_loss_pays_for_stays_silent(gradflow_server):
    run_id = train(gradflow_server, 3e-3, HEALTHY_STEPS)
    rms = gradflow_server.series(run_id, "act_rms", "layers.1")
    assert len(rms) == HEALTHY_STEPS
    assert growth_alerts(gradflow_server, run_id) == []
    assert gradflow_server.serious(run_id) == []

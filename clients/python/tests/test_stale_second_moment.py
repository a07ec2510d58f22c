"""`adam_second_moment_stale` on a CPU recipe through the real client, beside its
healthy twins.

The tiny GPT of test_instabilities.py learns a bigram chain over the lower half of
its vocabulary for 300 steps; then the data mixture changes and the upper half
appears (new data in the mix mid-run). The output head's rows for the new tokens had
almost no gradient for 300 steps, so with β₂ = 0.999 Adam's second moment for them
is tiny when their gradients arrive: the largest |m̂/(√v̂+ε)| climbs from at most 1.4
before the change to about 3.5 after it, for tens of steps. With β₂ = 0.95 the
second moment follows within a few steps (at most 1.1), and without the change
nothing goes stale.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch
from test_instabilities import CONTEXT, VOCAB, run_gpt

SHIFT = 300
STEPS = 420


def shifted_batches(
    shift_at: Optional[int], batch: int = 16
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """A sparse random bigram chain over tokens below VOCAB/2, and from `shift_at`
    on (never when None) over the whole vocabulary."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, 2), generator=g)
    lower = successors % (VOCAB // 2)
    for step in range(STEPS):
        table = successors if shift_at is not None and step >= shift_at else lower
        x = torch.empty(batch, CONTEXT + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB // 2, (batch,), generator=g)
        choice = torch.randint(0, 2, (batch, CONTEXT), generator=g)
        for i in range(CONTEXT):
            x[:, i + 1] = table[x[:, i], choice[:, i]]
        yield x[:, :-1], x[:, 1:]


def train(server: Any, beta2: float, shift_at: Optional[int]) -> str:
    return run_gpt(
        server,
        shifted_batches(shift_at),
        prefix="stale",
        signals={"adam": 1},
        lr=3e-3,
        betas=(0.9, beta2),
        weight_decay=0.0,
    )


def stale_alerts(server: Any, run_id: str) -> List[Any]:
    return [a for a in server.alerts(run_id) if a["kind"] == "adam_second_moment_stale"]


def test_new_data_against_a_slow_second_moment_is_caught(gradflow_server):
    run_id = train(gradflow_server, 0.999, SHIFT)
    alert = gradflow_server.wait_for_alert(run_id, "adam_second_moment_stale")
    assert (alert["subject"], alert["severity"]) == ("param group 0", "info")
    assert SHIFT <= alert["first_step"] <= SHIFT + 10
    assert alert["evidence"]["beta2"] == pytest.approx(0.999)
    assert alert["evidence"]["update_absmax"] > 2.5
    assert "lm_head" in alert["evidence"]["modules"]
    # The embedding's rows go stale too, but sparse rows are healthy: never named.
    assert "tok" not in alert["evidence"]["modules"]
    before = [
        v for s, v in gradflow_server.series(run_id, "adam_update_absmax", "lm_head") if s < SHIFT
    ]
    assert len(before) == SHIFT and max(before) < 1.7


@pytest.mark.parametrize(("beta2", "shift_at"), [(0.95, SHIFT), (0.999, None)])
def test_a_fast_second_moment_or_steady_data_stays_silent(gradflow_server, beta2, shift_at):
    run_id = train(gradflow_server, beta2, shift_at)
    absmax = gradflow_server.series(run_id, "adam_update_absmax", "lm_head")
    assert len(absmax) == STEPS
    assert stale_alerts(gradflow_server, run_id) == []

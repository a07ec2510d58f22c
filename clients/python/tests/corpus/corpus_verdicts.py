"""Verdict helpers of the corpus cases from other kinds of training (the shared ones
are in corpus_support)."""

from __future__ import annotations

from typing import Any

import pytest
from corpus_support import described

SERIOUS = ("warning", "critical")


def held_silent(server: Any, run_id: str, steps: int) -> None:
    """`silent_and_stored` whose false alarm fails through `pytest.fail`, as a missed
    verdict does, so that a strict xfail "false alarm: ..." (`not_caught`) holds only
    for the alarm: a step not stored, or a PyTorch-side check, still fails the test."""
    stored = server.run(run_id)["step_count"]
    assert stored == steps, f"the server stored {stored} of {steps} steps"
    serious = server.serious(run_id)
    if serious:
        pytest.fail(f"false alarm: {described(serious)}")


def nothing_else(server: Any, run_id: str, *kinds: str) -> None:
    """No warning or critical alert of another kind than `kinds` on the run."""
    others = [a["kind"] for a in server.alerts(run_id) if a["severity"] in SERIOUS]
    assert set(others) <= set(kinds), others

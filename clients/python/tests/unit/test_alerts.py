"""How an alert is worded, and shown once."""

from __future__ import annotations

import warnings

import pytest

from gradflow.alerts import AlertBox
from gradflow.errors import GradflowAlertWarning, TrainingAlert, describe

CUT = {
    "id": 7,
    "kind": "grad_stuck_zero",
    "subject": "encoder",
    "severity": "critical",
    "title": "Backward never reaches encoder",
    "fix": "Find where the path is cut.",
    "evidence": {
        "graph_cut": {
            "module": "encoder",
            "kind": "no_grad",
            "stack": [
                {"file": "train.py", "line": 39, "function": "forward"},
                {"file": "train.py", "line": 47},
            ],
        }
    },
}


def test_an_alert_reads_as_what_where_and_fix():
    assert describe(CUT) == (
        "[critical] grad_stuck_zero on encoder: Backward never reaches encoder\n"
        "  where: encoder (no_grad) at train.py:39 in forward, called from train.py:47\n"
        "  fix: Find where the path is cut."
    )


def test_each_alert_is_warned_once():
    box = AlertBox("warn")
    box.offer([CUT])
    box.offer([CUT])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box.deliver()
        box.deliver()
    shown = [w for w in caught if w.category is GradflowAlertWarning]
    assert len(shown) == 1 and "where: encoder (no_grad)" in str(shown[0].message)


def test_raise_mode_raises_the_critical_alert():
    box = AlertBox("raise")
    box.offer([CUT])
    with pytest.raises(TrainingAlert) as raised:
        box.deliver()
    assert raised.value.kind == "grad_stuck_zero"


def test_a_wrong_mode_is_refused():
    with pytest.raises(ValueError, match="on_alert"):
        AlertBox("loud")

"""How an alert is worded, and said once: one short log line per episode."""

from __future__ import annotations

import warnings

import pytest
from said import alerts_said

from gradflow.delivery.alerts import AlertBox
from gradflow.errors import TrainingAlert, describe

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


def test_each_alert_is_said_once_short_with_the_run_page_and_never_as_a_warning():
    box = AlertBox("warn")
    box.dashboard = lambda: "http://127.0.0.1:7070/runs/r1"
    box.offer([CUT])
    box.offer([CUT])
    with alerts_said() as said, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box.deliver()
        box.deliver()
    assert said == [describe(CUT) + "\n  see: http://127.0.0.1:7070/runs/r1"]
    assert len(said[0].splitlines()) == 4  # what, where, fix, page
    assert caught == []  # one channel: the log line, not also a warning


def test_an_episode_the_server_reopens_is_said_once():
    box = AlertBox("warn")
    flap = dict(CUT, kind="loss_divergence", subject="loss", severity="warning", evidence={})
    with alerts_said() as said:
        for episode in range(1, 6):  # opened, resolved, opened again under a new id
            box.offer([dict(flap, id=100 + episode)])
            box.deliver()
            box.offer([])
            box.deliver()
    assert len(said) == 1, said
    assert said[0].startswith("[warning] loss_divergence on loss")


def test_an_episode_that_returns_more_severe_is_said_again():
    box = AlertBox("warn")
    warning = dict(CUT, id=1, severity="warning")
    critical = dict(CUT, id=2, severity="critical")
    with alerts_said() as said:
        box.offer([warning])
        box.deliver()
        box.offer([warning, critical])
        box.deliver()
        box.offer([dict(CUT, id=3, severity="warning")])
        box.deliver()
    assert [m.split("]")[0] for m in said] == ["[warning", "[critical"]


def test_an_info_alert_is_for_the_dashboard_only():
    box = AlertBox("warn")
    box.offer([dict(CUT, kind="first_step_hint", severity="info")])
    with alerts_said() as said:
        box.deliver()
    assert said == []


def test_raise_mode_raises_the_critical_alert_instead_of_saying_it():
    box = AlertBox("raise")
    box.dashboard = lambda: "http://127.0.0.1:7070/runs/r1"
    box.offer([CUT])
    with alerts_said() as said, pytest.raises(TrainingAlert) as raised:
        box.deliver()
    assert raised.value.kind == "grad_stuck_zero"
    assert str(raised.value).endswith("see: http://127.0.0.1:7070/runs/r1")
    assert said == []  # the traceback says it


def test_raise_mode_says_the_alert_where_it_cannot_raise():
    box = AlertBox("raise")
    box.offer([CUT])
    with alerts_said() as said:
        box.deliver(raising=False)
    assert len(said) == 1 and said[0].startswith("[critical] grad_stuck_zero on encoder")


def test_a_wrong_mode_is_refused():
    with pytest.raises(ValueError, match="on_alert"):
        AlertBox("loud")

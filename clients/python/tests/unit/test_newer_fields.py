"""What the reporter strips from a step record that a server of an older protocol
refused: only the fields that server cannot know, nothing else."""

import json

from gradflow.delivery.older_servers import without_newer_fields


def test_wiring_and_a_cut_s_via_are_stripped_and_the_rest_kept():
    record = {
        "step": 3,
        "loss": 1.5,
        "amend": {"params": [{"name": "w"}], "wiring": [{"kind": "clip_after_step"}]},
        "graph_cuts": [
            {"module": "m", "kind": "no_grad", "via": "reentrant_checkpoint"},
            {"module": "n", "kind": "detached_input"},
        ],
    }
    bare = json.loads(without_newer_fields(json.dumps(record)) or "null")
    assert bare == {
        "step": 3,
        "loss": 1.5,
        "amend": {"params": [{"name": "w"}]},
        "graph_cuts": [
            {"module": "m", "kind": "no_grad"},
            {"module": "n", "kind": "detached_input"},
        ],
    }


def test_an_amendment_of_wiring_only_goes_whole():
    record = {"step": 1, "amend": {"wiring": [{"kind": "params_created_in_forward"}]}}
    assert json.loads(without_newer_fields(json.dumps(record)) or "null") == {"step": 1}


def test_a_record_without_them_is_not_sent_again():
    assert without_newer_fields(json.dumps({"step": 1, "graph_cuts": [{"module": "m"}]})) is None
    assert without_newer_fields("not json") is None


def test_a_rank_s_local_nonfinite_flag_is_stripped():
    record = {"step": 7, "rank": 1, "loss": 0.5, "local_grads_nonfinite": True}
    bare = json.loads(without_newer_fields(json.dumps(record)) or "null")
    assert bare == {"step": 7, "rank": 1, "loss": 0.5}


def test_the_optimizer_step_count_is_stripped():
    record = {"step": 4, "loss": 0.5, "optimizer_steps": 5}
    bare = json.loads(without_newer_fields(json.dumps(record)) or "null")
    assert bare == {"step": 4, "loss": 0.5}

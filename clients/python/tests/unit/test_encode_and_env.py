"""Numbers on the wire and settings from the environment (no torch, no server)."""

from __future__ import annotations

import pytest

from gradflow import _env
from gradflow.measurement import encode
from gradflow.options import WatchOptions, webhook_specs


def test_non_finite_numbers_travel_as_strings():
    assert encode.number(1.5) == 1.5
    assert encode.number(float("nan")) == "NaN"
    assert encode.number(float("inf")) == "Infinity"
    assert encode.number(float("-inf")) == "-Infinity"


def test_a_negative_norm_is_sent_as_nan_never_as_a_negative_number():
    assert encode.norm(None) is None
    assert encode.norm(2.0) == 2.0
    assert encode.norm(-1.0) == "NaN"
    assert encode.norm(float("-inf")) == "NaN"
    assert encode.norm(float("inf")) == "Infinity"


def test_counts_are_whole_and_non_negative():
    assert encode.count(3.0000001) == 3
    assert encode.count(-1.0) is None
    assert encode.count(float("nan")) is None


def test_server_urls_get_a_scheme_lose_trailing_slashes_and_repeats(monkeypatch):
    monkeypatch.delenv("GRADFLOW_SERVER", raising=False)
    assert _env.servers(None) == [_env.DEFAULT_SERVER]
    assert _env.servers("h:1/, http://h:1 ,,https://g/") == ["http://h:1", "https://g"]
    monkeypatch.setenv("GRADFLOW_SERVER", "a:1,b:2")
    assert _env.servers(None) == ["http://a:1", "http://b:2"]
    assert _env.servers(["c:3"]) == ["http://c:3"]
    with pytest.raises(ValueError, match="no server URL"):
        _env.servers(" , ")


def test_run_ids_are_checked_or_generated_from_the_name(monkeypatch):
    monkeypatch.delenv("GRADFLOW_RUN_ID", raising=False)
    assert _env.run_id("mine", None) == ("mine", False)
    generated, was_generated = _env.run_id(None, "my run/1")
    assert was_generated and generated.startswith("my-run-1-")
    with pytest.raises(ValueError, match="not valid"):
        _env.run_id("a b", None)
    monkeypatch.setenv("GRADFLOW_RUN_ID", "from-env")
    assert _env.run_id(None, None) == ("from-env", False)


def test_options_take_arguments_first_then_the_environment(monkeypatch):
    monkeypatch.setenv("GRADFLOW_SERVER", "env:1")
    monkeypatch.setenv("GRADFLOW_INGEST_TOKEN", "t0k")
    monkeypatch.setenv("GRADFLOW_CLOSE_TIMEOUT", "2.5")
    monkeypatch.setenv("GRADFLOW_SPOOL_DIR", "/spool")
    monkeypatch.setenv("GRADFLOW_SPOOL_MAX_BYTES", "not a number")
    options = WatchOptions.resolve(detectors={"stuck_zero_steps": 5})
    assert options.servers == ["http://env:1"] and options.token == "t0k"
    assert options.close_timeout == 2.5 and options.spool_dir == "/spool"
    assert options.spool_max_bytes == 256 * 1024 * 1024
    assert options.detectors == {"stuck_zero_steps": 5}
    explicit = WatchOptions.resolve(server="arg:2", token="x", close_timeout=0.0)
    assert explicit.servers == ["http://arg:2"] and explicit.token == "x"
    assert explicit.close_timeout == 0.0


def test_wrong_options_are_refused_before_anything_is_attached():
    with pytest.raises(ValueError, match="every must be at least 1"):
        WatchOptions.resolve(server="h:1", every=0)
    with pytest.raises(ValueError, match="on_alert"):
        WatchOptions.resolve(server="h:1", on_alert="shout")
    with pytest.raises(TypeError, match="webhooks"):
        WatchOptions.resolve(server="h:1", webhooks=[42])


def test_webhooks_from_urls_and_dicts():
    slack = "https://hooks.slack.com/services/x"
    assert webhook_specs(slack) == [{"url": slack, "format": "slack"}]
    assert webhook_specs({"url": "http://h/a", "min_severity": "info"}) == [
        {"url": "http://h/a", "min_severity": "info"}
    ]

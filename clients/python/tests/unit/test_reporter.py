"""The reporter thread against a fake server: order, outages and the close summary."""

from __future__ import annotations

import time

from fakes import FakeServer, Step

from gradflow.delivery.reporter import Reporter
from gradflow.delivery.spool import Spool


def reporter(tmp_path, server: FakeServer) -> Reporter:
    spool = Spool(str(tmp_path / "run.ndjson"), 1 << 20)
    r = Reporter([server], "run", {"params": []}, spool, None, flush_interval=0.05)  # type: ignore[list-item]
    r.start()
    return r


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_steps_arrive_in_order_and_the_run_is_finished(tmp_path):
    server = FakeServer()
    r = reporter(tmp_path, server)
    for step in range(5):
        r.submit(Step(step))
    r.close(5.0)
    assert server.steps == [0, 1, 2, 3, 4] and server.finished
    r.spool.close()
    summary = r.summary()
    assert (summary.delivered, summary.pending, summary.dropped) == (5, 0, 0)


def test_an_outage_spools_and_replays_in_order(tmp_path):
    server = FakeServer()
    server.up = False
    r = reporter(tmp_path, server)
    for step in range(3):
        r.submit(Step(step))
    wait_for(lambda: len(r.spool) == 3)
    server.up = True
    for step in range(3, 5):
        r.submit(Step(step))
    r.close(10.0)
    r.spool.close()
    assert server.steps == [0, 1, 2, 3, 4]


def test_what_is_left_when_the_server_never_answers_is_counted(tmp_path):
    server = FakeServer()
    server.up = False
    r = reporter(tmp_path, server)
    for step in range(4):
        r.submit(Step(step))
    r.close(0.5)
    summary = r.summary()
    r.spool.close()
    assert summary.delivered == 0 and summary.pending == 4
    assert summary.spool_path.endswith("run.ndjson")

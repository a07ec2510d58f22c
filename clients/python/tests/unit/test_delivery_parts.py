"""The reporter's parts on their own, against fake servers: the hand-off queue, the
move to another server with the registration, and the sender's spool-first order."""

from __future__ import annotations

import json
from typing import List

from fakes import FakeServer, Step

from gradflow.delivery.registrar import Registrar
from gradflow.delivery.sender import Sender
from gradflow.delivery.servers import Servers
from gradflow.delivery.spool import Spool
from gradflow.delivery.step_queue import StepQueue
from gradflow.delivery.tally import Tally


def lines(*steps: int) -> List[str]:
    return [json.dumps(Step(s).record()) for s in steps]


def parts(tmp_path, *clients: FakeServer):
    spool = Spool(str(tmp_path / "run.ndjson"), 1 << 20)
    servers = Servers(list(clients), "run", spool.path)  # type: ignore[arg-type]
    registrar = Registrar(servers, {"params": []}, announce=False)  # type: ignore[typeddict-item]
    tally = Tally()
    return servers, registrar, Sender(servers, registrar, spool, tally, batch_size=2), tally


def test_a_full_queue_drops_the_step_and_counts_it():
    tally = Tally()
    q = StepQueue(2, batch_size=8, flush_interval=0.01, gather=0.01, tally=tally)
    for step in range(3):
        q.put(Step(step))
    assert tally.dropped == 1 and len(q) == 2
    items, stopping = q.take()
    assert [i.record()["step"] for i in items] == [0, 1] and not stopping
    q.stop(0.1)
    assert q.take() == ([], True)


def test_a_batch_takes_at_most_batch_size_steps_and_the_stop_comes_after_them():
    q = StepQueue(16, batch_size=2, flush_interval=0.01, gather=0.01, tally=Tally())
    for step in range(3):
        q.put(Step(step))
    q.stop(0.1)
    first, stopping = q.take()
    assert [i.record()["step"] for i in first] == [0, 1] and not stopping
    second, stopping = q.take()
    assert [i.record()["step"] for i in second] == [2] and stopping


def test_the_registration_and_the_batch_move_with_the_server(tmp_path):
    a, b = FakeServer("http://a:1"), FakeServer("http://b:1")
    servers, registrar, sender, tally = parts(tmp_path, a, b)
    sender.deliver(lines(0))
    assert a.steps == [0] and len(a.registered) == 1 and not b.registered
    a.up = False
    sender.deliver(lines(1, 2, 3))
    assert b.steps == [1, 2, 3] and len(b.registered) == 1
    assert servers.switches == [("http://a:1", "http://b:1")] and registrar.registered
    assert tally.delivered_to == {"http://a:1": 1, "http://b:1": 3}
    sender.spool.close()


def test_while_no_server_answers_steps_are_spooled_and_sent_first_after(tmp_path):
    a = FakeServer()
    servers, registrar, sender, tally = parts(tmp_path, a)
    a.up = False
    sender.deliver(lines(0, 1))
    assert servers.outage is not None and len(sender.spool) == 2 and not a.steps
    a.up = True
    servers.retry_now()
    sender.deliver(lines(2))
    assert a.steps == [0, 1, 2] and not len(sender.spool) and servers.outage is None
    assert tally.delivered == 3
    sender.spool.close()

"""The on-disk spool: bounded, replayed in order, leaves only what is undelivered."""

from __future__ import annotations

from gradflow.delivery.spool import Spool


def test_lines_come_back_in_order_and_delivered_ones_are_forgotten(tmp_path):
    spool = Spool(str(tmp_path / "s" / "run.ndjson"), 1 << 20)
    assert spool.append(['{"step":0}', '{"step":1}', '{"step":2}']) == 0
    assert len(spool) == 3
    assert spool.peek(2) == ['{"step":0}', '{"step":1}']
    spool.advance(2)
    assert spool.peek(5) == ['{"step":2}']
    spool.close()
    assert (tmp_path / "s" / "run.ndjson").read_text() == '{"step":2}\n'


def test_a_full_spool_says_how_many_lines_it_dropped(tmp_path):
    spool = Spool(str(tmp_path / "run.ndjson"), 25)
    assert spool.append(["a" * 10, "b" * 10, "c" * 10]) == 1
    assert len(spool) == 2
    spool.close()


def test_an_emptied_spool_is_deleted_at_close(tmp_path):
    path = tmp_path / "run.ndjson"
    spool = Spool(str(path), 1 << 20)
    spool.append(["x"])
    spool.advance(1)
    spool.close()
    assert not path.exists()

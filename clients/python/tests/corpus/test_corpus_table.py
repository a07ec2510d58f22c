"""The corpus table in docs/failure-corpus.md says, for every case, what the tests
here hold: caught (a plain test), wrong cause or missed (a strict xfail whose reason
starts so), silent or false alarm (the healthy look-alikes: test_corpus_healthy and
every file that sets ``LOOK_ALIKES = True``). When a detector starts
catching a case its xfail fails; once the mark is removed, this test fails until
the table says so too."""

from __future__ import annotations

import importlib
import re
from collections import Counter
from pathlib import Path
from typing import Dict

HERE = Path(__file__).resolve().parent
TABLE = HERE.parents[3] / "docs" / "failure-corpus.md"
STATUSES = ("caught", "wrong cause", "missed", "silent", "false alarm")


def status_of(function, healthy: bool) -> str:
    for mark in getattr(function, "pytestmark", []):
        if mark.name == "xfail":
            reason = mark.kwargs.get("reason", "")
            assert mark.kwargs.get("strict") is True, f"{function.__name__}: xfail must be strict"
            for status in ("wrong cause", "missed", "false alarm"):
                if reason.startswith(status + ":"):
                    return status
            raise AssertionError(f"{function.__name__}: xfail reason {reason!r} names no status")
    return "silent" if healthy else "caught"


def cases() -> Dict[str, str]:
    found = {}
    for path in sorted(HERE.glob("test_corpus_*.py")):
        if path.stem == "test_corpus_table":
            continue
        module = importlib.import_module(path.stem)
        for name in dir(module):
            if name.startswith("test_"):
                healthy = getattr(module, "LOOK_ALIKES", path.stem == "test_corpus_healthy")
                found[name] = status_of(getattr(module, name), healthy)
    return found


def table() -> Dict[str, str]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        named = re.search(r"`(test_\w+)`", line)
        if line.startswith("|") and named:
            status = cells[-1].strip("*").lower()
            assert status in STATUSES, f"{named.group(1)}: unknown status {cells[-1]!r}"
            rows[named.group(1)] = status
    return rows


def test_the_table_lists_every_case_with_its_status():
    assert table() == cases()


def test_the_count_line_adds_up():
    counts = Counter(cases().values())
    failures = counts["caught"] + counts["wrong cause"] + counts["missed"]
    healthy = counts["silent"] + counts["false alarm"]
    line = (
        f"{failures} failures: {counts['caught']} caught, {counts['wrong cause']} wrong cause, "
        f"{counts['missed']} missed. {healthy} healthy look-alikes: {counts['silent']} silent, "
        f"{counts['false alarm']} false alarms."
    )
    assert line in TABLE.read_text(), line

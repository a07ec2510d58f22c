"""The corpus table in docs/failure-corpus.md says, for every case, what the tests
here hold: the verdict the case declares (`@expects(kind, subject, cause)`, or
`@expects_silence` for a healthy look-alike: the table's Kind, Subject and Cause
cells), and its status: caught (a plain test), wrong cause or missed (a strict xfail
whose reason starts so, on the test or on one of its seeds), silent or false alarm
(the look-alikes). When a detector starts catching a case its xfail fails; once the
mark is removed, this test fails until the table says so too."""

from __future__ import annotations

import importlib
import re
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from corpus_support import NONE, declaration

HERE = Path(__file__).resolve().parent
TABLE = HERE.parents[3] / "docs" / "failure-corpus.md"
STATUSES = ("caught", "wrong cause", "missed", "silent", "false alarm")

# kind, subjects, cause, status
Row = Tuple[str, Tuple[str, ...], str, str]


def xfail_marks(function: Any) -> Iterator[Any]:
    """The xfail marks on the test and on any of its parameters (a seed it misses)."""
    for mark in getattr(function, "pytestmark", []):
        if mark.name == "xfail":
            yield mark
        if mark.name == "parametrize":
            for value in mark.args[1]:
                for inner in getattr(value, "marks", ()):
                    if inner.name == "xfail":
                        yield inner


def status_of(function: Any, healthy: bool) -> str:
    for mark in xfail_marks(function):
        reason = mark.kwargs.get("reason", "")
        assert mark.kwargs.get("strict") is True, f"{function.__name__}: xfail must be strict"
        for status in ("wrong cause", "missed", "false alarm"):
            if reason.startswith(status + ":"):
                return status
        raise AssertionError(f"{function.__name__}: xfail reason {reason!r} names no status")
    return "silent" if healthy else "caught"


def cases() -> Dict[str, Row]:
    found = {}
    for path in sorted(HERE.glob("test_corpus_*.py")):
        if path.stem == "test_corpus_table":
            continue
        module = importlib.import_module(path.stem)
        for name in dir(module):
            if name.startswith("test_"):
                declared = declaration(getattr(module, name))
                status = status_of(getattr(module, name), declared.silence)
                found[name] = (*declared.cells(), status)
    return found


def code(cell: str) -> str:
    """A cell holding one name in backticks (or the plain `—` / `any`)."""
    names = re.findall(r"`([^`]+)`", cell)
    return names[0] if names else cell


def table() -> Dict[str, Row]:
    """The rows of every table whose header has Kind, Subject, Cause and Verdict."""
    rows = {}
    header: List[str] = []
    for line in TABLE.read_text().splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = cells
            continue
        named = re.search(r"`(test_\w+)`", cells[0])
        if not named or "Verdict" not in header:
            continue
        column = dict(zip(header, cells))
        status = column["Verdict"].strip("*").lower()
        assert status in STATUSES, f"{named.group(1)}: unknown status {column['Verdict']!r}"
        subjects = tuple(re.findall(r"`([^`]+)`", column["Subject"]))
        rows[named.group(1)] = (
            code(column["Kind"]),
            subjects if subjects else (() if column["Subject"] == NONE else (column["Subject"],)),
            code(column["Cause"]),
            status,
        )
    return rows


def test_the_table_lists_every_case_with_its_verdict_and_status():
    found, listed = cases(), table()
    assert sorted(found) == sorted(listed), set(found) ^ set(listed)
    differ = {name: (found[name], listed[name]) for name in found if found[name] != listed[name]}
    assert not differ, f"(declared, table) differ: {differ}"


def test_the_count_line_adds_up():
    counts = Counter(row[-1] for row in cases().values())
    failures = counts["caught"] + counts["wrong cause"] + counts["missed"]
    healthy = counts["silent"] + counts["false alarm"]
    line = (
        f"{failures} failures: {counts['caught']} caught, {counts['wrong cause']} wrong cause, "
        f"{counts['missed']} missed. {healthy} healthy look-alikes: {counts['silent']} silent, "
        f"{counts['false alarm']} false alarms."
    )
    assert line in TABLE.read_text(), line

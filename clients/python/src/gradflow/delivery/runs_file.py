"""The runs a script registered, told to ``gradflow check``.

``gradflow check`` sets ``GRADFLOW_CHECK_RUNS_FILE`` for the script it runs;
:func:`gradflow.watch` appends the id of each run it reports to that file, so that
the check judges exactly the runs the script registered: a ``run_id=`` of the
script's own on a shared server is found too, and nobody else's run is. Every rank
of a multi-rank run appends the same id; the check reads each once.
"""

from __future__ import annotations

import os
from typing import List

RUNS_FILE_ENV = "GRADFLOW_CHECK_RUNS_FILE"


def note_run(run_id: str) -> None:
    """Appends `run_id` to the file ``gradflow check`` named, if it named one. One
    short append of a whole line (``O_APPEND``), so processes writing at once do not
    interleave; a file that cannot be written is left alone (the check then says the
    script reported no run)."""
    path = os.environ.get(RUNS_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as out:
            out.write(run_id + "\n")
    except OSError:
        pass


def read_runs(path: str) -> List[str]:
    """The run ids in the file, each once, in the order they were first written."""
    try:
        with open(path, encoding="utf-8") as lines:
            ids = [line.strip() for line in lines]
    except OSError:
        return []
    return list(dict.fromkeys(i for i in ids if i))

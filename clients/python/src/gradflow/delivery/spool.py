"""A bounded on-disk queue of encoded step records (NDJSON), replayed in order.

Records go here while the server is out of reach, and everything after them too, so
that the server always receives steps in order. The file lives until every line in
it has been delivered; a run that ends with lines still in it names the file.

Beside it, from the moment it is created, lies ``FILE.registration.json``: the run
id and registration that ``gradflow report`` and ``gradflow-server import`` need, so
that a spool left by a run that never reached its close (a second Ctrl-C, a killed
process) can still be read. Both files go when the spool is emptied at close.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, BinaryIO, List, Optional


class Spool:
    def __init__(self, path: str, max_bytes: int, sidecar: Optional[Any] = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.sidecar = sidecar  # JSON written beside the spool when it is created
        self._offsets: List[int] = []  # start of each undelivered line
        self._end = 0
        self._file: Optional[BinaryIO] = None

    @property
    def sidecar_path(self) -> str:
        return self.path + ".registration.json"

    def __len__(self) -> int:
        return len(self._offsets)

    def _open(self) -> BinaryIO:
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "w+b")  # noqa: SIM115 (kept open for the run)
            if self.sidecar is not None:
                with open(self.sidecar_path, "w") as f:
                    json.dump(self.sidecar, f)
        return self._file

    def append(self, lines: List[str]) -> int:
        """Appends what fits; returns how many lines did not (dropped)."""
        f = self._open()
        f.seek(self._end)
        written = 0
        for line in lines:
            data = line.encode() + b"\n"
            if self._end + len(data) > self.max_bytes:
                break
            f.write(data)
            self._offsets.append(self._end)
            self._end += len(data)
            written += 1
        f.flush()
        return len(lines) - written

    def peek(self, n: int) -> List[str]:
        if not self._offsets:
            return []
        f = self._open()
        f.seek(self._offsets[0])
        out = []
        for _ in range(min(n, len(self._offsets))):
            out.append(f.readline().decode().rstrip("\n"))
        return out

    def advance(self, n: int) -> None:
        """Forgets the first n lines (delivered or refused)."""
        del self._offsets[:n]
        if not self._offsets and self._file is not None:
            # Empty again: start the file over so it does not grow without bound.
            self._file.seek(0)
            self._file.truncate()
            self._end = 0

    def close(self) -> None:
        """Closes the file; deletes it when nothing is left to deliver, and otherwise
        leaves exactly the undelivered lines in it."""
        if self._file is not None:
            if self._offsets:
                rest = self.peek(len(self._offsets))
                self._file.seek(0)
                self._file.truncate()
                self._file.write("".join(line + "\n" for line in rest).encode())
            self._file.close()
            self._file = None
            if not self._offsets:
                for path in (self.path, self.sidecar_path):
                    with contextlib.suppress(OSError):
                        os.remove(path)

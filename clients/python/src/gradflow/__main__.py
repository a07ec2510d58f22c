"""``python -m gradflow`` / ``gradflow``: the package's commands (``check``,
``report``, ``server``). Nothing here imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional

USAGE = (
    "usage: gradflow check [options] -- COMMAND...   (gradflow check --help)\n"
    "       gradflow report SPOOL [--out FILE]         (gradflow report --help)\n"
    "       gradflow server [OPTIONS] [COMMAND]        (gradflow server --help: the\n"
    "                                                   gradflow-server this package installed)\n"
    "       gradflow --version"
)


def server(args: List[str]) -> int:
    """``gradflow server ARGS`` is ``gradflow-server ARGS``: the binary the wheel
    installed (or ``GRADFLOW_SERVER_BIN``, or the PATH's), in this process's place."""
    from .check import find_server_binary

    binary = find_server_binary()
    if binary is None:
        print(
            "gradflow server: no gradflow-server: this gradflow was installed without it "
            "(an editable install); set GRADFLOW_SERVER_BIN or put gradflow-server on the PATH",
            file=sys.stderr,
        )
        return 3
    if os.name == "posix":
        sys.stdout.flush()
        os.execv(binary, [binary, *args])  # signals (Ctrl-C) reach the server itself
    return subprocess.call([binary, *args])


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from . import __version__

        print(f"gradflow {__version__}")
        return 0
    if args[0] == "check":
        from .check import main as check

        return check(args[1:])
    if args[0] == "report":
        from .report import main as report

        return report(args[1:])
    if args[0] == "server":
        return server(args[1:])
    print(f"gradflow: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

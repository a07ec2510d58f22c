"""``python -m gradflow`` / ``gradflow``: the package's commands (``check``,
``report``)."""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = (
    "usage: gradflow check [options] -- COMMAND...   (gradflow check --help)\n"
    "       gradflow report SPOOL [--out FILE]         (gradflow report --help)"
)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "check":
        from .check import main as check

        return check(args[1:])
    if args[0] == "report":
        from .report import main as report

        return report(args[1:])
    print(f"gradflow: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

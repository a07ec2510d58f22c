"""``gradflow report SPOOL``: a self-contained HTML report of a run no server saw.

    gradflow report /tmp/gradflow-spool/RUN.1234.ndjson [--out report.html]

When the server was out of reach for the end of a run, the client leaves its spool
and ``SPOOL.registration.json`` beside it. This command loads both into an embedded
``gradflow-server`` (the same binary ``gradflow check`` starts) on a temporary
database, so the run is diagnosed exactly as if it had been delivered, and writes the
server's own run page as one file: the stylesheet inlined, every chart inlined as an
SVG data URI, the script left out. It opens in any browser, offline, and can be
attached to a ticket. ``gradflow-server import SPOOL`` loads the same spool into a
real server's database instead.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
from typing import Any, List, Optional, Sequence
from urllib.parse import quote

from .check import CheckError, EmbeddedServer, _server_binary
from .transport import Client, Refused, Unreachable

BATCH = 500


def _read_spool(spool: str) -> tuple:
    sidecar = spool + ".registration.json"
    if not os.path.exists(sidecar):
        raise CheckError(f"{sidecar} is missing: the run id and registration come from it")
    with open(sidecar) as f:
        meta = json.load(f)
    with open(spool) as f:
        lines = [line.strip() for line in f if line.strip()]
    return str(meta["run_id"]), meta["registration"], lines


def _get_text(client: Client, path: str) -> str:
    """A page or an asset, as text (the JSON client only reads JSON)."""
    import urllib.request

    with urllib.request.urlopen(client.server + path, timeout=30) as response:
        return response.read().decode()


def _inline(client: Client, html: str) -> str:
    def stylesheet(match: re.Match[str]) -> str:
        return "<style>" + _get_text(client, match.group(1)) + "</style>"

    def chart(match: re.Match[str]) -> str:
        src = match.group(1).replace("&amp;", "&")
        svg = _get_text(client, src).encode()
        data = base64.b64encode(svg).decode()
        return f'src="data:image/svg+xml;base64,{data}"'

    html = re.sub(r'<link rel="stylesheet" href="([^"]+)">', stylesheet, html)
    html = re.sub(r"<script[^>]*></script>", "", html)
    html = html.replace('loading="lazy"', "")
    return re.sub(r'src="(/api/v1/runs/[^"]+\.svg[^"]*)"', chart, html)


def write_report(spool: str, out: str, server_bin: Optional[str] = None) -> dict:
    run_id, registration, lines = _read_spool(spool)
    server = EmbeddedServer(_server_binary(server_bin))
    try:
        client = Client(server.url, None, timeout=60)
        try:
            client.register(run_id, registration)
            for start in range(0, len(lines), BATCH):
                client.post_steps(run_id, lines[start : start + BATCH])
            alerts = client.alerts(run_id, status="all")
            html = _get_text(client, f"/runs/{quote(run_id)}")
            html = _inline(client, html)
        except (Refused, Unreachable) as err:
            raise CheckError(f"the embedded server refused the spool: {err}") from None
    finally:
        server.stop()
    with open(out, "w") as f:
        f.write(html)
    return {"run_id": run_id, "steps": len(lines), "alerts": alerts, "out": out}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradflow report",
        description="Write a self-contained HTML report of a run from its spool.",
    )
    parser.add_argument("spool", help="the spool file the client left (SPOOL.ndjson)")
    parser.add_argument("--out", help="the report (default: SPOOL.html)")
    parser.add_argument("--server-bin", help="the gradflow-server binary to start")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = args.out or re.sub(r"\.ndjson$", "", args.spool) + ".html"
    try:
        done: Any = write_report(args.spool, out, args.server_bin)
    except (CheckError, OSError, ValueError, KeyError) as err:
        print(f"gradflow report: {err}", file=sys.stderr)
        return 3
    alerts: List[Any] = done["alerts"]
    loud = [a for a in alerts if a.get("severity") != "info"]
    print(
        f"gradflow report: {done['out']}: run {done['run_id']}, {done['steps']} steps, "
        f"{len(loud)} alert(s)" + "".join(f"\n  [{a['severity']}] {a['title']}" for a in loud)
    )
    return 0

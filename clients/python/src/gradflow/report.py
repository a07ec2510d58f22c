"""``gradflow report SPOOL``: a self-contained HTML report of a run no server saw.

    gradflow report /tmp/gradflow-spool/RUN.1234.ndjson [--out report.html]
                    [--server URL | --server-bin PATH]

When the server was out of reach for the end of a run, the client leaves its spool
and ``SPOOL.registration.json`` beside it. This command loads both into an embedded
``gradflow-server`` (the same binary ``gradflow check`` starts: the one the wheel
installed, unless ``--server-bin`` or ``GRADFLOW_SERVER_BIN`` names another) on a
temporary database, so the run is diagnosed exactly as if it had been delivered,
marks it finished, and writes the server's own run page as one file: the stylesheet
inlined, every chart inlined as an SVG data URI, and what only works against a live
server left out (the script, the step-range form, the module filter, links to other
pages and to the API, the time since the last batch). It opens in any browser,
offline, and can be attached to a ticket. With ``--server URL`` the spool is
delivered to that running server instead (where the run stays, as
``gradflow-server import SPOOL`` would store it) and the report is written from its
page. ``gradflow-server import SPOOL`` loads the same spool into a server's database.
"""

from __future__ import annotations

import argparse
import base64
import html as htmllib
import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote

from .check import CheckError, EmbeddedServer, _server_binary, probe
from .delivery.transport import Client, Refused, Unreachable

BATCH = 500


def _read_spool(spool: str) -> Tuple[str, Dict[str, Any], List[str]]:
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

    request = urllib.request.Request(client.server + path)
    if client.token:
        request.add_header("Authorization", f"Bearer {client.token}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(response.read().decode())


def _inline(client: Client, html: str) -> str:
    def stylesheet(match: re.Match[str]) -> str:
        return "<style>" + _get_text(client, match.group(1)) + "</style>"

    def chart(match: re.Match[str]) -> str:
        src = match.group(1).replace("&amp;", "&")
        svg = _get_text(client, src).encode()
        data = base64.b64encode(svg).decode()
        return f'src="data:image/svg+xml;base64,{data}"'

    html = re.sub(r'<link rel="stylesheet" href="([^"]+)">', stylesheet, html)
    html = html.replace('loading="lazy"', "")
    return re.sub(r'src="(/api/v1/runs/[^"]+\.svg[^"]*)"', chart, html)


def _offline(html: str, spool: str) -> str:
    """The run page without what needs the live server: the script and the live
    indicator, the step-range form, the module filter and the sort buttons (they
    reload or script the page), the PNG links and every link to another page or the
    API (they would open nothing), and the time since the last batch (true only when
    the page was served). A line under the title says what the file is."""
    html = re.sub(r"<script\b[^>]*>.*?</script>", "", html, flags=re.S)
    html = re.sub(r'<span[^>]*id="live-indicator"[^>]*>.*?</span>', "", html, flags=re.S)
    html = re.sub(r'<nav class="breadcrumb".*?</nav>', "", html, flags=re.S)
    html = re.sub(r'<section id="range".*?</section>', "", html, flags=re.S)
    html = re.sub(r"<form\b.*?</form>", "", html, flags=re.S)
    html = re.sub(r'<div class="table-tools".*?</div>', "", html, flags=re.S)
    html = re.sub(r"<label\b[^>]*>(?:(?!</label>).)*<input\b.*?</label>", "", html, flags=re.S)
    html = re.sub(r"<input\b[^>]*>", "", html)
    html = re.sub(r"<button\b[^>]*>(.*?)</button>", r"\1", html, flags=re.S)
    html = re.sub(r'<a class="chart-link"[^>]*>.*?</a>', "", html, flags=re.S)
    html = re.sub(r"<div><dt>Last batch</dt>.*?</div>", "", html, flags=re.S)
    # Links into the server (same-origin paths) become their text.
    html = re.sub(
        r'<a\b([^>]*?)\shref="/[^"]*"([^>]*)>(.*?)</a>', r"<span\1\2>\3</span>", html, flags=re.S
    )
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    note = (
        '<p class="muted offline-note">Offline report, generated '
        f"{stamp} by gradflow report from {htmllib.escape(os.path.basename(spool))}.</p>"
    )
    return html.replace("</h1>", "</h1>" + note, 1)


def write_report(
    spool: str, out: str, server_bin: Optional[str] = None, server: Optional[str] = None
) -> Dict[str, Any]:
    run_id, registration, lines = _read_spool(spool)
    token = os.environ.get("GRADFLOW_INGEST_TOKEN") if server else None
    if server:
        probe(server, token)
    embedded = None if server else EmbeddedServer(_server_binary(server_bin, also=""))
    where = "the embedded server" if embedded else server
    try:
        client = Client(server or embedded.url, token, timeout=60)  # type: ignore[union-attr]
        try:
            client.register(run_id, registration)
            for start in range(0, len(lines), BATCH):
                client.post_steps(run_id, lines[start : start + BATCH])
            if embedded is not None:
                client.finish(run_id)  # the spool is all the run will ever send
            alerts = client.alerts(run_id, status="all")
            html = _get_text(client, f"/runs/{quote(run_id)}")
            html = _offline(_inline(client, html), spool)
        except (Refused, Unreachable) as err:
            raise CheckError(f"{where} refused the spool: {err}") from None
    finally:
        if embedded is not None:
            embedded.stop()
    with open(out, "w") as f:
        f.write(html)
    return {"run_id": run_id, "steps": len(lines), "alerts": alerts, "out": out}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradflow report",
        description="Write a self-contained HTML report of a run from its spool.",
        allow_abbrev=False,
    )
    parser.add_argument("spool", help="the spool file the client left (SPOOL.ndjson)")
    parser.add_argument("--out", help="the report (default: SPOOL.html)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--server", help="deliver the spool to this running server and report from it"
    )
    where.add_argument("--server-bin", help="the gradflow-server binary to start")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = args.out or re.sub(r"\.ndjson$", "", args.spool) + ".html"
    server = args.server.rstrip("/") if args.server else None
    if server and "://" not in server:
        server = f"http://{server}"
    try:
        done: Any = write_report(args.spool, out, args.server_bin, server)
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

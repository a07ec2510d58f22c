"""Settings from arguments first, then GRADFLOW_* environment variables."""

from __future__ import annotations

import os
import re
import secrets
import time
from typing import List, Optional, Sequence, Union

DEFAULT_SERVER = "http://127.0.0.1:7070"


def disabled() -> bool:
    return os.environ.get("GRADFLOW_DISABLED", "").strip().lower() in ("1", "true", "yes", "on")


def servers(explicit: Union[None, str, Sequence[str]]) -> List[str]:
    """The servers to report to, in the order they are tried: ``server=`` (a URL, a
    comma-separated string of them, or a list), else ``GRADFLOW_SERVER`` (one URL or
    several, comma-separated), else the default. A URL without a scheme gets
    ``http://``; repeats are dropped."""
    given: Union[str, Sequence[str]] = (
        explicit if explicit else os.environ.get("GRADFLOW_SERVER") or DEFAULT_SERVER
    )
    items = given.split(",") if isinstance(given, str) else [str(item) for item in given]
    urls: List[str] = []
    for item in items:
        url = item.strip()
        if not url:
            continue
        if "://" not in url:
            url = "http://" + url
        url = url.rstrip("/")
        if url not in urls:
            urls.append(url)
    if not urls:
        raise ValueError(f"no server URL in {given!r}")
    return urls


def token(explicit: Optional[str]) -> Optional[str]:
    return explicit or os.environ.get("GRADFLOW_INGEST_TOKEN") or None


_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def run_id(explicit: Optional[str], name: Optional[str]) -> tuple[str, bool]:
    """The run id and whether it was generated (then it is printed once)."""
    chosen = explicit or os.environ.get("GRADFLOW_RUN_ID")
    if chosen:
        if not _RUN_ID.match(chosen) or chosen in (".", ".."):
            raise ValueError(
                f"run id {chosen!r} is not valid: 1 to 128 letters, digits, '.', '_' or '-'"
            )
        return chosen, False
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name or "run").strip("-.")[:64] or "run"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stem}-{stamp}-{secrets.token_hex(3)}", True


def float_env(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default

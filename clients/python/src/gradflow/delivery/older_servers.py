"""What a server of an older protocol refuses, and the registration and records
without it: the client sends what such a server can store rather than nothing."""

from __future__ import annotations

import json
from typing import Any, Optional

from .transport import Refused

V18_STEP_FIELDS = ("output_logits", "moe", "batch")
# v1.9 fields a v1.8 server refuses, dropped with the v1.8 ones.
V19_STEP_FIELDS = ("optimizer_steps",)
V18_MODULE_FIELDS = ("attn_max_logit", "attn_min_entropy", "act_rms", "act_absmax", "adam")


def refused_newer_field(registration: Any, err: Refused) -> Optional[str]:
    """The newer field of `registration` an older server refused with `err`, if any."""
    if err.status != 400:
        return None
    said = f"{err.message or ''} {err.path or ''}"
    for newer in ("mode_dependent_modules", "signals"):
        if newer in registration and newer in said:
            return newer
    return "wiring" if "wiring" in registration else None


def strip_v18(record: Any) -> bool:
    """Removes a record's v1.8 and v1.9 fields (the instability signals, the optimizer
    steps) in place: module entries that carried nothing else go; True when anything
    was removed."""
    changed = False
    for key in V18_STEP_FIELDS + V19_STEP_FIELDS:
        changed = record.pop(key, None) is not None or changed
    modules = record.get("modules")
    if not isinstance(modules, list):
        return changed
    kept = []
    for entry in modules:
        if isinstance(entry, dict):
            removed = [entry.pop(key) for key in V18_MODULE_FIELDS if key in entry]
            changed = changed or bool(removed)
            if removed and set(entry) == {"module"}:
                continue
        kept.append(entry)
    if len(kept) != len(modules):
        record["modules"] = kept
    if not kept:
        record.pop("modules", None)
    return changed


def without_newer_fields(line: str) -> Optional[str]:
    """The encoded step record `line` without what a server of an older protocol
    refuses (its instability signals, its amendment's wiring findings, its graph
    cuts' `via`, its `local_grads_nonfinite`), or None when it carries none of them."""
    try:
        record = json.loads(line)
        changed = strip_v18(record)
        changed = record.pop("local_grads_nonfinite", None) is not None or changed
        amend = record.get("amend")
        if isinstance(amend, dict) and "wiring" in amend:
            del amend["wiring"]
            if not amend:
                del record["amend"]
            changed = True
        for cut in record.get("graph_cuts") or []:
            if isinstance(cut, dict) and cut.pop("via", None) is not None:
                changed = True
        return json.dumps(record, separators=(",", ":")) if changed else None
    except (ValueError, AttributeError, TypeError):
        return None

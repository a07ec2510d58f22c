"""The step metric both framework callbacks send: they read the gradients before
their framework clips them (so a spike shows its real size), and tell the server the
clip's bound, under which a reading above it reached the optimizer cut down to it
(docs/PROTOCOL.md, ``metrics``; ``grad_explosion`` reads it)."""

from __future__ import annotations

from typing import Any, Dict, Optional

CLIP_METRIC = "grad_clip_max_norm"


def clip_metrics(bound: Any) -> Optional[Dict[str, float]]:
    """The step's metrics for a norm clip of `bound` (None: no clip, or not a norm
    clip above 0)."""
    if not isinstance(bound, (int, float)) or isinstance(bound, bool) or not bound > 0:
        return None
    return {CLIP_METRIC: float(bound)}

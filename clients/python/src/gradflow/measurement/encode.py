"""Numbers as the protocol writes them: JSON has no NaN or infinity."""

from __future__ import annotations

import math
from typing import Optional, Union

Number = Union[float, str]


def number(x: float) -> Number:
    """Any float: non-finite values become "NaN", "Infinity" or "-Infinity"."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def norm(x: Optional[float]) -> Optional[Number]:
    """A norm, drift or update size: never negative, so a reduction that produced a
    negative or -inf value (max over NaN on some devices) is sent as NaN, which the
    server reads as a non-finite measurement instead of rejecting the record."""
    if x is None:
        return None
    if math.isnan(x) or x < 0:
        return "NaN"
    if math.isinf(x):
        return "Infinity"
    return x


def count(x: float) -> Optional[int]:
    """A count carried as a float on the device; None when it is not a number."""
    if math.isnan(x) or math.isinf(x) or x < 0:
        return None
    return int(round(x))

"""How the report writes numbers, in its tables and its figures' legends."""

from __future__ import annotations

from typing import Optional

import numpy as np


def with_interval(point: float, low: float, high: float, digits: Optional[int] = None) -> str:
    if np.isnan(point):
        return "-"
    show = (lambda x: f"{x:.{digits}f}") if digits is not None else number
    return f"{show(point)} [{show(low)}, {show(high)}]"


def number(x: float) -> str:
    if x is None or np.isnan(x):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def steps(x: float) -> str:
    return f"{int(round(x)):,}"


def duration(seconds: float) -> str:
    if np.isnan(seconds):
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def exact(value: float) -> str:
    """A number as short as it can be written and still read back the same."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))

"""Line charts drawn on the server as SVG: the console's loss and metric curves.

Why SVG from the server rather than a JavaScript charting library: a curve here is one polyline of
at most stepmetrics.MAX_POINTS points with two axes, which is ~60 lines to draw and needs nothing in
the browser: the page works with scripts off, there is no vendored file to keep current, and the
live refresh swaps one HTML fragment. Hover read-outs come from each point's <title>.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The drawing's coordinate box; the SVG scales to its container's width (viewBox), so one size
# serves a laptop and a 360 px phone.
WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 28
# Above this many points the markers are left out (they would merge into a thick line).
MARKERS_UP_TO = 120


@dataclass
class Chart:
    name: str
    points: list[tuple[int, float]]  # (step = the op's seq_id, value)
    polyline: str
    markers: list[tuple[float, float, int, float]]  # (x, y, step, value)
    y_ticks: list[tuple[float, str]]  # (y, label)
    x_ticks: list[tuple[float, str]]
    last: float


def fmt(v: float) -> str:
    return f"{v:.4g}"


def _scale(lo: float, hi: float, a: float, b: float):
    span = hi - lo
    return (lambda v: (a + b) / 2) if span == 0 else (lambda v: a + (v - lo) / span * (b - a))


def chart(name: str, points: list[tuple[int, float]]) -> Chart:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    y_lo, y_hi = min(ys), max(ys)
    if y_lo == y_hi:  # a flat line sits mid-height, with its value as the one tick
        y_lo, y_hi = y_lo - abs(y_lo) * 0.1 - 1e-9, y_hi + abs(y_hi) * 0.1 + 1e-9
    sx = _scale(min(xs), max(xs), LEFT, WIDTH - RIGHT)
    sy = _scale(y_lo, y_hi, HEIGHT - BOTTOM, TOP)
    coords = [(round(sx(x), 1), round(sy(y), 1)) for x, y in points]
    markers = [(cx, cy, x, y) for (cx, cy), (x, y) in zip(coords, points)] if len(points) <= MARKERS_UP_TO else []
    y_ticks = [(round(sy(v), 1), fmt(v)) for v in _ticks(y_lo, y_hi)]
    x_vals = sorted({xs[0], xs[len(xs) // 2], xs[-1]})
    x_ticks = [(round(sx(v), 1), str(v)) for v in x_vals]
    return Chart(name, points, " ".join(f"{x},{y}" for x, y in coords), markers, y_ticks, x_ticks, ys[-1])


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """About n round values between lo and hi (1, 2 or 5 times a power of ten apart)."""
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * step:
            step *= m
            break
    first = math.ceil(lo / step) * step
    out, v = [], first
    while v <= hi + step * 1e-9 and len(out) < 2 * n + 2:
        out.append(round(v, 12))
        v += step
    return out

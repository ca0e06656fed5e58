"""The soak's verdict (benchmarks/soak.py): is a quantity bounded over wall time?

What the server holds is swept on wall-clock timers (checkpoint TTL, futures retention windows),
not per step, and a shared machine's step rate moves 3-5x with the load. So the series is judged on
windows of wall time, each several retention periods long (a window then holds whole fill-and-sweep
cycles, so its peak is the cycle's peak whatever the phase); comparing step-based thirds instead
once said "NOT bounded" for a data dir whose peak was 108.3 MiB early and 109.5 MiB late, because
one third happened to hold only troughs (steps 200-300 took 377 s at load 8).

The first window is warm-up (TTLs and windows fill up). The windows after it are judged twice:
- split into an earlier and a later half, the later half's peak is within `tolerance` (plus an
  absolute `slack`) of the earlier half's;
- a least-squares line through the window peaks rises by at most `max_growth_per_hour` (default:
  `tolerance`) of the first peak, plus `slack`, an hour. A leak moves the two halves' peaks by
  only half the run's growth (+55% over a half hour showed as 21% between the halves), so the
  trend is what catches it; a bounded sawtooth has none.

What is held is bounded by retention time x step rate (a 60 s TTL keeps 60 s worth of checkpoints),
so the verdict holds only while the step rate is steady: the last soak's rate rose 50x with the
machine's load and the data dir's peak rose with it (65.6 MiB in the slow windows, 123-139 MiB in
the fast). `steady_rate` checks that first; the soak paces its steps (`--step-interval-s`) so that
a loaded machine can still hold the rate.
"""

from __future__ import annotations

from dataclasses import dataclass

HOUR_S = 3600.0
# A window's peak counts only with this many samples in it: the soak measures at least every 30 s, so
# a 210 s window has 7; the old soak's every-100-steps had 1-2 at load, each could fall on a trough.
MIN_SAMPLES = 4


@dataclass(frozen=True)
class Verdict:
    bounded: bool | None  # None: the run is too short for a verdict
    earlier_peak: float
    later_peak: float
    growth_per_hour: float  # the peaks' trend, relative to the first judged peak (0.07 = +7% an hour)
    window_peaks: tuple[float | None, ...]  # the first is warm-up
    window_s: float

    def describe(self, unit: str = "", scale: float = 1.0) -> str:
        if self.bounded is None:
            return (f"no verdict: too short or too sparse (needs 3 windows of {self.window_s:.0f} s with "
                    f"{MIN_SAMPLES} samples each)")
        peaks = " ".join("-" if p is None else f"{p / scale:.1f}" for p in self.window_peaks)
        return (f"{'bounded' if self.bounded else 'GROWING'} (peak {self.earlier_peak / scale:.1f}{unit} in the earlier "
                f"half, {self.later_peak / scale:.1f}{unit} in the later; {self.growth_per_hour:+.1%} an hour; "
                f"peaks per {self.window_s:.0f} s window: {peaks})")


def window_peaks(times: list[float], values: list[float], window_s: float, min_samples: int = 1) -> list[float | None]:
    """Peaks of consecutive windows of `window_s` wall seconds from t=0 (None: fewer than
    `min_samples` samples in it, too few to have seen its peak); the tail shorter than a window joins
    the last whole window, so every window spans at least `window_s`."""
    n = int(times[-1] // window_s) if times else 0
    buckets: list[list[float]] = [[] for _ in range(n)]
    for t, v in zip(times, values):
        if n:
            buckets[min(int(t // window_s), n - 1)].append(v)
    return [max(b) if len(b) >= min_samples else None for b in buckets]


def rise_per_hour(peaks: list[float | None], window_s: float) -> float:
    """Slope of the least-squares line through the peaks (at their windows' centres), per hour."""
    points = [((i + 0.5) * window_s, p) for i, p in enumerate(peaks) if p is not None]
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var * HOUR_S if var else 0.0


def growth_per_hour(peaks: list[float | None], window_s: float) -> float:
    """rise_per_hour relative to the first peak."""
    first = next(p for p in peaks if p is not None)
    return rise_per_hour(peaks, window_s) / first if first else 0.0


def window_rates(times: list[float], steps: list[int], window_s: float) -> list[float | None]:
    """Steps per second in each of window_peaks' windows (None: under two samples in it)."""
    n = int(times[-1] // window_s) if times else 0
    first: list[tuple[float, int] | None] = [None] * n
    last: list[tuple[float, int] | None] = [None] * n
    for t, k in zip(times, steps):
        if n:
            i = min(int(t // window_s), n - 1)
            first[i] = first[i] or (t, k)
            last[i] = (t, k)
    return [(b[1] - a[1]) / (b[0] - a[0]) if a and b and b[0] > a[0] else None for a, b in zip(first, last)]


def steady_rate(times: list[float], steps: list[int], window_s: float, max_ratio: float = 1.5) -> tuple[bool, list[float | None]]:
    """Whether the judged windows' (all but the warm-up) step rates stay within max_ratio of each other."""
    rates = window_rates(times, steps, window_s)
    judged = [r for r in rates[1:] if r]
    return bool(judged) and max(judged) <= max_ratio * min(judged), rates


def judge(times: list[float], values: list[float], window_s: float, tolerance: float, slack: float = 0.0,
          max_growth_per_hour: float | None = None, min_samples: int = MIN_SAMPLES) -> Verdict:
    """Bounded if, after a warm-up window, the later half's peak is within tolerance (+ slack) of the
    earlier half's, and the peaks' trend rises by at most max_growth_per_hour (default: tolerance)
    of the first peak (+ slack) an hour."""
    peaks = window_peaks(times, values, window_s, min_samples)
    judged = peaks[1:]  # the first window is warm-up
    half = len(judged) // 2
    earlier = [p for p in judged[:half] if p is not None]
    later = [p for p in judged[half:] if p is not None]
    if not earlier or not later:
        return Verdict(None, 0.0, 0.0, 0.0, tuple(peaks), window_s)
    first = next(p for p in judged if p is not None)
    rise = rise_per_hour(judged, window_s)
    growth = rise / first if first else 0.0
    limit = tolerance if max_growth_per_hour is None else max_growth_per_hour
    ok = max(later) <= max(earlier) * (1 + tolerance) + slack and rise <= limit * first + slack
    return Verdict(ok, max(earlier), max(later), growth, tuple(peaks), window_s)

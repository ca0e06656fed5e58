"""The soak's verdict (benchmarks/soak_verdict.py) on synthetic series: it must say bounded for a
sawtooth however the samples fall in steps, and GROWING for a leak."""

from __future__ import annotations

import math
import random

from benchmarks.soak_verdict import growth_per_hour, judge, steady_rate, window_peaks

PERIOD_S = 70.0  # the soak's default retention period: a 60 s TTL + a 10 s sweep
WINDOW_S = 3 * PERIOD_S


def sawtooth(t: float, base: float = 80.0, amplitude: float = 30.0) -> float:
    """Fills for a period, then the sweep drops it back: the data dir under a TTL."""
    return base + amplitude * ((t % PERIOD_S) / PERIOD_S)


def uneven_times(total_s: float, seed: int = 0) -> list[float]:
    """Sample times of a soak measured every N steps while the step rate swings 5x with the load."""
    rng, t, times = random.Random(seed), 0.0, []
    while t < total_s:
        times.append(t)
        t += rng.choice([5.0, 25.0])
    return times


def test_bounded_sawtooth_is_bounded_on_uneven_samples():
    times = uneven_times(1800)
    v = judge(times, [sawtooth(t) for t in times], WINDOW_S, tolerance=0.25, slack=2.0)
    assert v.bounded is True
    assert abs(v.later_peak - v.earlier_peak) < 2.0
    assert abs(v.growth_per_hour) < 0.05


def test_the_step_thirds_trap():
    """The case that fooled the step-based verdict: measured every N steps while the steps ran
    slowly, the samples fell one retention period apart, each just after a sweep, so the middle
    third of the samples held only troughs. By wall time those windows are too sparse to judge and
    the others are bounded; the same process measured every 30 s at most (as the soak now does) is
    bounded in every window."""
    sparse = [45.0 * i for i in range(10)]  # 0..405 s
    sparse += [490.0 + PERIOD_S * i for i in range(10)]  # 490..1120 s: one per cycle, at the trough
    sparse += [1190.0 + 45.0 * i for i in range(10)]  # 1190..1595 s
    values = [sawtooth(t) for t in sparse]
    third = len(values) // 3
    assert max(values[third:2 * third]) == 80.0
    assert max(values[2 * third:]) > 1.25 * max(values[third:2 * third])  # thirds said NOT bounded
    v = judge(sparse, values, WINDOW_S, tolerance=0.25, slack=2.0)
    assert v.window_peaks[2:5] == (None, None, None)  # 1-3 samples each, all troughs: not judged
    assert v.bounded is True
    dense = sorted(set(sparse) | {30.0 * i for i in range(54)})
    v = judge(dense, [sawtooth(t) for t in dense], WINDOW_S, tolerance=0.25, slack=2.0)
    assert v.bounded is True and None not in v.window_peaks
    assert abs(v.later_peak - v.earlier_peak) < 0.05 * v.earlier_peak


def test_leak_is_growing():
    times = uneven_times(1800, seed=1)
    values = [sawtooth(t) + 60.0 * t / 1800 for t in times]  # +60 MiB over the half hour under the sawtooth
    v = judge(times, values, WINDOW_S, tolerance=0.25, slack=2.0)
    assert v.bounded is False
    assert v.later_peak > v.earlier_peak
    assert v.growth_per_hour > 0.5


def test_slow_rss_leak_fails_on_growth_per_hour_alone():
    """+8% in half an hour moves half-run peaks by less than a 10% tolerance; the trend catches it."""
    times = [i * 30.0 for i in range(61)]
    values = [900.0 * (1 + 0.08 * t / 1800) for t in times]
    assert judge(times, values, WINDOW_S, tolerance=0.10, max_growth_per_hour=0.5).bounded is True
    v = judge(times, values, WINDOW_S, tolerance=0.10, max_growth_per_hour=0.05)
    assert v.bounded is False
    assert math.isclose(v.growth_per_hour, 0.16, rel_tol=0.15)


def test_flat_rss_with_a_plateau_step_in_warm_up_is_flat():
    times = [i * 30.0 for i in range(61)]
    values = [886.0 if t < 100 else 918.0 for t in times]
    v = judge(times, values, WINDOW_S, tolerance=0.10, max_growth_per_hour=0.05)
    assert v.bounded is True and v.growth_per_hour == 0.0


def test_too_short_has_no_verdict():
    times = [i * 30.0 for i in range(15)]  # 420 s: warm-up and one window, no second half
    assert judge(times, [1.0] * len(times), WINDOW_S, tolerance=0.25).bounded is None


def test_window_peaks_fold_the_tail_into_the_last_window():
    assert window_peaks([0, 5, 10, 15, 22, 29], [1, 4, 2, 3, 9, 7], 10) == [4, 9]
    assert window_peaks([0, 10, 35, 41], [1, 2, 5, 3], 10) == [1, 2, None, 5]  # a window with no sample
    assert window_peaks([0, 1, 10, 35, 41], [1, 2, 2, 5, 3], 10, min_samples=2) == [2, None, None, 5]


def test_growth_per_hour_skips_empty_windows():
    assert math.isclose(growth_per_hour([1.0, None, 3.0], 1800), 2.0)  # +2 in 3600 s, relative to 1


def test_steady_rate_refuses_a_run_whose_step_rate_moved():
    """What is held is retention time x step rate: the last soak's 50x rate jump raised the data
    dir's peak 2x and the verdict said NOT bounded for a process that was bounded at each rate. A
    rate that moved over max_ratio between the judged windows gives no verdict; a steady one does,
    whatever the warm-up window did."""
    times = [10.0 * i for i in range(100)]  # 990 s, windows of 210 s: 4 (the tail joins the last)
    steady_steps = [0] + [5 + 4 * i for i in range(1, 100)]  # slow first step (warm-up), then 0.4/s
    ok, rates = steady_rate(times, steady_steps, WINDOW_S)
    assert ok and all(abs(r - 0.4) < 1e-9 for r in rates[1:])
    jump = [int(0.4 * t) if t < 600 else int(240 + 20 * (t - 600)) for t in times]  # 0.4/s, then 20/s
    ok, rates = steady_rate(times, jump, WINDOW_S)
    assert not ok and max(r for r in rates[1:] if r) > 10 * min(r for r in rates[1:] if r)
    assert steady_rate(times, jump, WINDOW_S, max_ratio=100.0)[0]

"""tools.bench.lock_trace: the split of the lock's time into held, hand-over and
idle, on traces whose answer is known (pure arithmetic, no processes: the
real traces are tools.bench.scale --trace's, run in test_bench_scale)."""

from __future__ import annotations

import numpy as np
import pytest

from tools.bench import lock_trace


def _traces(k: int):
    """Two processes, k periods of 50 ns each: A holds [0, 10); B, which
    asked at 5 (its turn came at 11), holds [12, 20): a 2 ns hand-over; the
    lock is idle [20, 30); A, asking at 30, holds [30, 40) at once (a Python
    hold); idle [40, 50)."""
    a, b = [], []
    for i in range(k):
        o = 50 * i
        a += [o, o, o, o + 10, 0, o + 30, o + 30, o + 30, o + 40, 2]
        b += [o + 5, o + 11, o + 12, o + 20, 0]
    return [a, b]


def test_the_lock_time_splits_into_held_hand_over_and_idle():
    k = 60
    r = lock_trace.analyse(_traces(k), trim=0)
    span = 50 * k - 10
    assert r["holds"] == 3 * k
    assert r["held_share"] == pytest.approx(28 * k / span)
    assert r["handover_share"] == pytest.approx(2 * k / span)
    assert r["idle_share"] == pytest.approx((20 * k - 10) / span)
    assert r["handover_us_p50"] == pytest.approx(0.002)
    # B's turn reached it at 11, after A's release at 10: every hand-over waited for the turn
    assert r["handovers_turn_not_come"] == pytest.approx(1.0)
    assert r["fused_holds"] == 2 * k and r["python_holds"] == k and r["wait_lock_holds"] == 0
    assert r["python_hold_us_mean"] == pytest.approx(0.010)
    # one process waits at the releases at 10 of each period, none at the others
    assert r["queue_mean"] == pytest.approx(k / (3 * k - 1), rel=0.05)


def test_a_turn_that_came_before_the_release_is_told_apart():
    tr = _traces(60)
    b = np.asarray(tr[1]).reshape(-1, 5)
    b[:, 1] = b[:, 0] + 1               # B's turn at 6: before A's release at 10
    r = lock_trace.analyse([tr[0], b.ravel()], trim=0)
    assert r["handovers_turn_not_come"] == 0.0


def test_too_few_holds_give_no_figures_and_the_report_skips_them():
    assert lock_trace.analyse(_traces(10)) == {}
    assert lock_trace.report([{"mix": "serving", "processes": 1, "trace": {}}]) == ""
    row = {"mix": "serving", "processes": 2, "trace": lock_trace.analyse(_traces(60))}
    out = lock_trace.report([row])
    assert "| serving | 2 |" in out and "hand-over" in out

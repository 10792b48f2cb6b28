"""Where the pool lock's time goes between holds: the analysis behind
``python -m tools.bench.scale --trace``.

Each process traces its holds of the pool lock (``_hot.log_holds(2)``, and
``PoolLock.trace`` for the Python path): for each, when it asked for the
lock, when its turn came (fused ops; the same as asked elsewhere), when it
had the lock and when it let it go, all CLOCK_MONOTONIC ns, which every
core shares. Merged and sorted by when each hold began, the gaps between one
release and the next hold split the lock's time into:

* **held**: some process holds it;
* **hand-over**: free while some process had asked for it and waits;
* **idle**: free, and nobody waiting.

A lock that is saturated but free a good part of the time loses that part
in hand-overs. For each hand-over the report also says what the next
holder was doing at the release: still waiting for its turn (the turn had
not reached it), or holding its turn and trying the mutex.
"""

from __future__ import annotations

import numpy as np

KINDS = ("fused", "wait_lock", "python")
WORDS = 5       # asked, turn, locked, released, kind (hot_mutex.h's trace_hold)


def merge(traces) -> np.ndarray:
    """One (n, 5) int64 array of every process's holds, sorted by lock time."""
    arrs = [np.asarray(t, dtype=np.int64).reshape(-1, WORDS) for t in traces if len(t)]
    if not arrs:
        return np.zeros((0, WORDS), dtype=np.int64)
    a = np.concatenate(arrs)
    return a[np.argsort(a[:, 2], kind="stable")]


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else 0.0


def analyse(traces, trim: float = 0.1) -> dict:
    """The lock's time split into held / hand-over / idle, over the middle
    of the run (``trim`` of the holds left off each end: start and stop).

    Returns:
        A dict of figures (times in µs, shares of the span in [0, 1]); an
        empty dict when fewer than 100 holds were traced.
    """
    a = merge(traces)
    if len(a) < 100:
        return {}
    k = int(len(a) * trim)
    a = a[k:len(a) - k]
    asked, turn, locked, released, kind = a.T
    span = float(released[-1] - locked[0])
    held = (released - locked).astype(np.float64)
    gap = (locked[1:] - released[:-1]).astype(np.float64)
    nxt = slice(1, None)
    # the next holder had asked before this release: the gap is a hand-over
    waiting = asked[nxt] < released[:-1]
    ho = np.clip(gap[waiting], 0, None)
    # where the next holder stood at the release: its turn had come, or not
    turn_late = waiting & (turn[nxt] > released[:-1])
    # how many processes waited at each release (asked before it, locked after)
    order = np.sort(asked)
    queued = (np.searchsorted(order, released[:-1], side="left")
              - np.searchsorted(locked, released[:-1], side="right"))
    out = {
        "holds": int(len(a)),
        "holds_per_s": len(a) / span * 1e9,
        "span_ms": span / 1e6,
        "held_share": float(held.sum()) / span,
        "handover_share": float(ho.sum()) / span,
        "idle_share": float(np.clip(gap[~waiting], 0, None).sum()) / span,
        "hold_us_mean": float(held.mean()) / 1e3,
        "handover_us_p50": _pct(ho, 50) / 1e3,
        "handover_us_p90": _pct(ho, 90) / 1e3,
        "handover_us_p99": _pct(ho, 99) / 1e3,
        "handover_us_mean": float(ho.mean()) / 1e3 if len(ho) else 0.0,
        "handovers_turn_not_come": float(turn_late[waiting].mean()) if waiting.any() else 0.0,
        "handover_us_mean_turn_not_come": (float(np.clip(gap[turn_late], 0, None).mean()) / 1e3
                                           if turn_late.any() else 0.0),
        "queue_mean": float(queued.mean()),
    }
    for i, name in enumerate(KINDS):
        m = kind == i
        out[f"{name}_holds"] = int(m.sum())
        out[f"{name}_hold_us_mean"] = float(held[m].mean()) / 1e3 if m.any() else 0.0
    return out


def report(rows) -> str:
    """A markdown table of analyse()'s figures, one line per traced point."""
    rows = [r for r in rows if r.get("trace")]
    if not rows:
        return ""
    heads = ("mix", "N", "holds/s", "held", "hand-over", "idle", "µs/hold",
             "hand-over µs p50/p90/p99 (mean)", "turn not come", "queue",
             "holds fused/wait_lock/python")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        t = r["trace"]
        lines.append(
            f"| {r['mix']} | {r['processes']} | {t['holds_per_s']:,.0f} | {t['held_share']:.0%} | "
            f"{t['handover_share']:.0%} | {t['idle_share']:.0%} | {t['hold_us_mean']:.2f} | "
            f"{t['handover_us_p50']:.2f}/{t['handover_us_p90']:.2f}/{t['handover_us_p99']:.1f} "
            f"({t['handover_us_mean']:.2f}) | {t['handovers_turn_not_come']:.0%} "
            f"({t['handover_us_mean_turn_not_come']:.2f} µs) | {t['queue_mean']:.1f} | "
            f"{t['fused_holds']}/{t['wait_lock_holds']}/{t['python_holds']} |")
    return ("the pool lock's time (--trace): held, handed over (free, someone waiting), idle; "
            "'turn not come': hand-overs whose next holder's turn had not reached it at the "
            "release (its mean gap); queue: processes waiting at a release\n" + "\n".join(lines))

"""``python -m tools.bench.step_logs``: it reads the step logs that
``workers/worker/step_timing.py`` writes (lines written here by that module
itself, for a stand-in engine whose methods only sleep: the format, not an
engine, is what is tested) and groups the steps by kind, rows and threads;
a folder that is not there is a one-line error and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import pytest

from tools.bench import step_logs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StandIn:
    """Stands in for an engine (step_timing keeps its log per engine object)."""
    rows: list = []


def write_log(tmp_path, monkeypatch, steps):
    """One engine's log: ``steps`` is a list of (rows, method names called)."""
    from workers.worker import step_timing
    monkeypatch.setattr(step_timing, "_DIR", str(tmp_path))
    eng = StandIn()
    for n in step_timing.NAMES:
        setattr(eng, n, lambda: time.sleep(0.001))
    step_timing.install(eng)
    for rows, called in steps:
        eng.rows = [None] * rows
        step_timing.begin(eng)
        for n in called:
            getattr(eng, n)()
        step_timing.end(eng)
    step_timing.close(eng)


@pytest.mark.timeout(60)
def test_steps_are_grouped_by_kind_rows_and_threads(tmp_path, monkeypatch):
    import shmcache.system.blas as blas
    threads = blas.threads() or 0
    write_log(tmp_path, monkeypatch, [
        (0, ["_admit"]),                                   # idle
        (0, ["_admit", "_prefill_chunk", "_forward_chunk"]),   # prefill, no rows
        (1, ["_admit", "_decode", "_sample"]),
        (1, ["_admit", "_decode", "_sample"]),
        (1, ["_admit", "_prefill_group", "_decode"]),     # prefill beside a row
        (2, ["_admit", "_decode", "_sample"]),
    ])
    r = step_logs.summarize(str(tmp_path))
    assert r["workers"] == 1 and r["steps"] == 6 and r["prefill_with_rows"] == 1
    g = r["groups"]
    assert sorted((k, len(v)) for k, v in g.items()) == [
        (("decode", 1, threads), 2), (("decode", 2, threads), 1), (("prefill", threads), 2)]
    assert all(ms >= 1.0 for v in g.values() for ms in v)   # each step slept at least 1 ms
    out = subprocess.run([sys.executable, "-m", "tools.bench.step_logs", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "1 prefill steps held running rows" in out.stdout
    assert f"  decode | 1 | {threads} | 2 |" in out.stdout, out.stdout


@pytest.mark.timeout(60)
def test_a_missing_folder_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.bench.step_logs", str(tmp_path / "no")],
                       cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "not a folder" in r.stderr


@pytest.mark.timeout(60)
def test_the_timeline_runs_decode_steps_together_and_lists_prefills(tmp_path, monkeypatch):
    import shmcache.system.blas as blas
    t = blas.threads() or 0
    write_log(tmp_path, monkeypatch, [
        (0, ["_admit", "_prefill_chunk", "_forward_chunk"]),
        (1, ["_admit", "_decode", "_sample"]),
        (1, ["_admit", "_decode", "_sample"]),
        (1, ["_admit", "_prefill_group", "_decode"]),
        (2, ["_admit", "_decode", "_sample"]),
        (0, ["_admit"]),                                   # idle: not shown
    ])
    (events,) = step_logs.timeline(str(tmp_path)).values()
    kinds = [e[0] for e in events]
    assert kinds == ["P", "D", "P", "D"], events
    assert events[0].startswith("P0.00+") and events[0].endswith(f"[0>0]t{t}")
    assert events[1].endswith(f"r1x2t{t}") and events[3].endswith(f"r2x1t{t}"), events
    out = subprocess.run([sys.executable, "-m", "tools.bench.step_logs", "--timeline",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert " ".join(events) in out.stdout

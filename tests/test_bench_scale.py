"""tools.bench.scale: a short real run (processes attached by name) gives
every figure, for every mix, and leaves no pool behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shmcache.shm import segment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_bench_scale_reports_both_mixes(tmp_path):
    before = set(segment.list_names())
    out = tmp_path / "scale.json"
    r = subprocess.run([sys.executable, "-m", "tools.bench.scale", "--processes", "1,2",
                        "--seconds", "0.5", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(x["mix"], x["processes"]) for x in rows] == [
        ("batched", 1), ("batched", 2), ("reserved", 1), ("reserved", 2), ("serving", 1),
        ("serving", 2)]
    assert all(x["ops_per_s"] > 0 and x["violations"] == 0 for x in rows)
    assert "| batched | 2 |" in r.stdout and "python -m tools.bench.scale" in r.stdout
    assert not [n for n in set(segment.list_names()) - before if n.startswith("bscale-")]


@pytest.mark.timeout(180)
def test_bench_scale_repeats_in_rounds_times_the_steps_and_runs_the_control(tmp_path):
    out = tmp_path / "scale.json"
    r = subprocess.run([sys.executable, "-m", "tools.bench.scale", "--processes", "1,2",
                        "--seconds", "0.3", "--repeat", "2", "--mix", "serving,control", "--steps",
                        "--trace", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((x["mix"], x["processes"]) for x in rows) == sorted(
        [(m, n) for m in ("serving", "control") for n in (1, 2)] * 2)
    assert "--repeat 2" in r.stdout and "| serving | 2 | " in r.stdout and "–" in r.stdout
    serving = [x for x in rows if x["mix"] == "serving"]
    # every step timed, and the fused calls' lock holds with them
    assert all(len(x["step_us"]) == 9 and min(x["step_us"]) > 0 for x in serving), serving
    assert "lock held / op" in r.stdout
    # the lock's time traced (--trace): every hold a fused one (no Python path in this mix)
    for x in serving:
        t = x["trace"]
        assert t["holds"] > 100 and t["python_holds"] == 0, t
        assert 0 < t["held_share"] < 1 and abs(
            t["held_share"] + t["handover_share"] + t["idle_share"] - 1) < 0.05, t
    assert "hand-over" in r.stdout
    assert all(x["step_us"] is None and x["waits_per_op"] == 0 for x in rows
               if x["mix"] == "control")
    bad = subprocess.run([sys.executable, "-m", "tools.bench.scale", "--repeat", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repeat: must be at least 1" in bad.stderr


@pytest.mark.timeout(120)
def test_bench_scale_runs_the_seeds_per_block_mix(tmp_path):
    """The ``perblock`` mix (the seed's per-block calls: get_computed_blocks,
    add_block_to_table each) runs and leaves the pool consistent."""
    out = tmp_path / "scale.json"
    # (one process, for a whole second: on a loaded machine a worker can
    # start after a short run's end and count no op)
    r = subprocess.run([sys.executable, "-m", "tools.bench.scale", "--processes", "1",
                        "--seconds", "1", "--mix", "perblock", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(x["mix"], x["processes"]) for x in rows] == [("perblock", 1)]
    assert all(x["ops_per_s"] > 0 and x["violations"] == 0 for x in rows)


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.environ.get("SHMCACHE_PURE") == "1", reason="traces the C accelerator's holds")
def test_bench_holds_counts_one_short_hold_per_per_block_call():
    """tools.bench.holds: every per-block call is one hold of the pool lock;
    add_block_to_table's and find_cached_block's are C holds (well under
    the 11-36 µs their Python holds took), and no pool is left behind."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    r = subprocess.run([sys.executable, "-m", "tools.bench.holds", "--calls", "200"], cwd=ROOT,
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): [float(x) for x in line.strip(" |").split(" | ")[1:]]
            for line in r.stdout.splitlines()[2:]}
    assert len(rows) == 9 and all(v[0] == 1.0 for v in rows.values()), r.stdout
    for call in ("add_block_to_table", "find_cached_block (32 blocks)", "free_block"):
        assert rows[call][1] < 5.0, r.stdout
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {f for f in after - before if "bholds" in f}

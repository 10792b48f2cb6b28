"""``python -m tools.bench.engine_step`` (a benchmark tool: tiny settings on the
demo model check that it runs both sides and prints their figures, not the
performance), and its one-line refusal of a bad --batch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_engine_step_prints_both_sides_per_batch_and_leaves_no_pool():
    p = subprocess.Popen([sys.executable, "-m", "tools.bench.engine_step", "--model", "demo",
                          "--batch", "1,2", "--context", "40", "--tokens", "10", "--rounds", "1"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=170)
    finally:
        p.kill()
    assert p.returncode == 0, out + err
    lines = [ln for ln in out.splitlines() if ln.startswith("B=")]
    assert [ln.split(";")[0] for ln in lines] == ["B=1", "B=2"]
    for ln in lines:
        assert "mlx-lm: step" in ln and "shmcache: step" in ln
        ratio = re.search(r"step shmcache/mlx-lm ([0-9.]+)-([0-9.]+)x", ln)
        assert ratio and float(ratio[1]) > 0
    # the pool it made (named after its pid) is gone
    assert not os.path.exists(f"/dev/shm/shmcache.bench-step-{p.pid}")


@pytest.mark.timeout(60)
def test_a_bad_batch_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "tools.bench.engine_step", "--batch", "two"],
                       cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2
    assert "--batch two" in r.stderr and r.stdout == ""

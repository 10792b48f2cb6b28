"""``python -m tools.bench.decode_scaling`` (a benchmark tool: tiny settings on
the demo model check that it starts the processes of each config together,
with --busy prefilling ones beside them and --pin's cores, and prints their
figures, not the performance), and its one-line refusals of bad flags."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_decode_scaling_prints_a_line_per_config():
    r = subprocess.run([sys.executable, "-m", "tools.bench.decode_scaling", "--model", "demo",
                        "--configs", "1x1x1,2x1x2", "--context", "32", "--steps", "6",
                        "--prefill", "16"], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln.split("|") for ln in r.stdout.splitlines() if ln.strip().split(" ")[0] in
            ("1x1x1", "2x1x2")]
    assert [c[0].strip() for c in rows] == ["1x1x1", "2x1x2"], r.stdout
    for c in rows:
        step, decode, prefill, blas_pct = (float(x) for x in c[1:])
        assert step > 0 and decode > 0 and prefill > 0 and blas_pct > 0
    # one process of one row: its decode tokens/s is one token per step
    step, decode = float(rows[0][1]), float(rows[0][2])
    assert abs(decode * step / 1000 - 1) < 0.02, rows[0]


@pytest.mark.timeout(180)
def test_busy_prefills_beside_the_decode_steps_on_cores_of_their_own():
    # --pin makes the tool check that every child ran on the cores it was
    # given (it fails otherwise); with one CPU, only the decoding process fits
    pin = len(os.sched_getaffinity(0)) >= 2
    r = subprocess.run([sys.executable, "-m", "tools.bench.decode_scaling", "--model", "demo",
                        "--configs", "1x1x1", "--context", "32", "--steps", "6", "--prefill",
                        "16"] + (["--busy", "1x1x2", "--pin"] if pin else ["--busy", "1x1x2"]),
                       cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "busy prefill tok/s" in r.stdout
    row = next(ln.split("|") for ln in r.stdout.splitlines()
               if ln.strip().startswith("1x1x1"))
    assert len(row) == 6 and float(row[5]) > 0, r.stdout     # the busy process prefilled


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, says", [
    (["--busy", "2x2"], "--busy '2x2'"),
    (["--configs", "4096x1x1", "--pin"], "--pin: 4096x1x1"),
])
def test_bad_busy_or_pin_is_one_line_and_exit_2(flags, says):
    r = subprocess.run([sys.executable, "-m", "tools.bench.decode_scaling"] + flags,
                       cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


@pytest.mark.timeout(60)
def test_too_few_steps_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "tools.bench.decode_scaling", "--steps", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "--steps 2" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


@pytest.mark.timeout(60)
def test_bad_configs_are_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "tools.bench.decode_scaling", "--configs", "8x2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2
    assert "--configs '8x2'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""

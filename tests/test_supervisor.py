"""End-to-end runs of ``python -m workers.supervisor`` with a small model.

Each run starts real worker processes over a real shared pool. Parity: the
tokens of every request are the same with the prefix cache on or off, with
workers SIGKILLed mid-run, and under memory pressure with preemptions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shmcache import segment
from workers import workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--layers", "2", "--dim", "64", "--system-tokens", "96", "--max-new-tokens", "6",
         "--block-size", "16", "--requests", "10", "--quiet"]


def run_supervisor(tmp_path, *extra, timeout=240):
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.Popen([sys.executable, "-m", "workers.supervisor", *SMALL, *extra,
                             "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    left = _own_pool_left(proc)
    assert not left, f"supervisor left its pool {left}"
    assert proc.returncode == 0, stdout + stderr
    return json.loads(out.read_text())


def _own_pool_left(proc) -> list:
    # The supervisor names its pool after its pid: remove only that one, never
    # another run's.
    name = f"run-{proc.pid}"
    return [name] if segment.unlink(name) else []


def outputs(report):
    return {r["id"]: r["outputs"] for r in report["requests"]}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return run_supervisor(tmp_path_factory.mktemp("base"), "--workers", "2")


@pytest.mark.timeout(300)
def test_report_has_every_key_and_is_clean(baseline):
    r = baseline
    for k in ("requests", "prefix_hit_rate", "leaked_blocks", "check_violations", "worker_restarts",
              "cow_copies", "evictions", "kv_bytes_in_pool", "kv_bytes_without_sharing",
              "throughput_tokens_per_s", "ttft_cached_s", "ttft_uncached_s"):
        assert k in r
    assert len(r["requests"]) == 10 and not r["failed"]
    for q in r["requests"]:
        for k in ("id", "worker", "prompt_tokens", "cached_tokens", "outputs", "ttft_s", "preemptions"):
            assert k in q
        assert len(q["outputs"]) == q["n"] and all(len(o) == 6 for o in q["outputs"])
    assert r["leaked_blocks"] == 0 and r["check_violations"] == 0
    assert r["prefix_hit_rate"] > 0.3          # the shared system prompt is reused
    assert r["cow_copies"] > 0                 # n > 1 requests copied their partial block
    assert r["kv_bytes_in_pool"] < r["kv_bytes_without_sharing"]
    assert {q["worker"] for q in r["requests"]} == {0, 1}


@pytest.mark.timeout(300)
def test_parity_without_prefix_cache(baseline, tmp_path):
    r = run_supervisor(tmp_path, "--workers", "2", "--no-prefix-cache")
    assert r["prefix_hit_rate"] == 0
    assert outputs(r) == outputs(baseline)


@pytest.mark.timeout(300)
def test_parity_with_workers_killed(tmp_path):
    # A longer workload than the baseline's, so kills land even on a fast machine.
    more = ["--requests", "30", "--max-new-tokens", "16"]
    calm = run_supervisor(tmp_path, "--workers", "2", *more)
    r = run_supervisor(tmp_path, "--workers", "2", "--kill-worker-every", "0.15", *more)
    assert r["worker_kills"] >= 1 and r["worker_restarts"] >= 1
    assert len(r["requests"]) == 30 and not r["failed"]
    assert r["leaked_blocks"] == 0 and r["check_violations"] == 0
    assert outputs(r) == outputs(calm)


@pytest.mark.timeout(300)
def test_parity_under_memory_pressure(baseline, tmp_path):
    reqs = workload.build(10, 0, 4096, 96, 6)
    need = sum(workload.blocks_needed(q, 16) for q in reqs)
    biggest = max(workload.blocks_needed(q, 16) for q in reqs)
    blocks = max(need // 4, biggest + 2)
    r = run_supervisor(tmp_path, "--workers", "2", "--max-blocks", str(blocks))
    assert r["max_blocks"] <= need // 4 + 1 or r["max_blocks"] == biggest + 2
    assert r["preemptions"] > 0 or r["evictions"] > 0
    assert r["leaked_blocks"] == 0 and r["check_violations"] == 0
    assert outputs(r) == outputs(baseline)


def test_bad_flags_are_rejected():
    proc = subprocess.run([sys.executable, "-m", "workers.supervisor", "--workers", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--workers" in proc.stderr


@pytest.mark.timeout(120)
def test_ctrl_c_stops_everything_and_leaves_nothing(tmp_path):
    import signal
    import time
    import psutil
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches
    # the supervisor and its workers at once.
    proc = subprocess.Popen([sys.executable, "-m", "workers.supervisor", *SMALL, "--requests", "400"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:   # wait until the workers run
            kids = psutil.Process(proc.pid).children(recursive=True)
            if len(kids) >= 2 and f"run-{proc.pid}" in segment.list_names():
                break
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    left = _own_pool_left(proc)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not left
    workers = [p for p in kids if "spawn_main" in " ".join(_cmdline(p))]
    assert len(workers) >= 2
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers still running after Ctrl-C: {alive}"


def _cmdline(p):
    try:
        return p.cmdline()
    except Exception:   # already gone
        return ["spawn_main"]


@pytest.mark.timeout(120)
def test_a_vanished_pool_stops_the_run_instead_of_restarting_forever():
    import time
    proc = subprocess.Popen([sys.executable, "-m", "workers.supervisor", *SMALL, "--requests", "400"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while f"run-{proc.pid}" not in segment.list_names() and time.time() < deadline:
            time.sleep(0.05)
        segment.unlink(f"run-{proc.pid}")      # an operator's mistake
        import psutil
        for k in psutil.Process(proc.pid).children():
            if "spawn_main" in " ".join(k.cmdline()):
                k.kill()                        # the next attach cannot find the pool
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 2, err
    assert "removed" in err or "before they were ready" in err

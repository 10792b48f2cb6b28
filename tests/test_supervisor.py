"""End-to-end runs of ``python -m tools.demo``: it starts ``shmcache
serve`` with the demo model (named with --model), drives it with the openai client and reports.

Each run is a subprocess under a hard timeout; afterwards no server, worker
or pool of its may be left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from shmcache.shm import segment
from shmcache.models.demo_model import ensure_demo_model
from tools.demo.run import QUESTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Short prompts and answers keep a run to seconds on a shared 2-core machine; so does
# the random-weight demo model (named explicitly: make run's default is SmolLM2).
SMALL = ["--system-tokens", "256", "--max-new-tokens", "8", "--quiet",
         "--model", str(ensure_demo_model(progress=False))]


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def run_supervisor(tmp_path, *extra, timeout=240, seen_out=None):
    """Runs the supervisor; ``seen_out`` (a dict), if given, gets every
    descendant process seen while it ran (pid -> psutil.Process)."""
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.Popen([sys.executable, "-m", "tools.demo", *SMALL, *extra,
                             "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = {}
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            for p in _descendants(proc.pid):     # the server and its workers, to check they end
                if p.pid not in seen:
                    seen[p.pid] = p
                    try:
                        p.name()                 # (cached: known after the process is gone)
                    except psutil.Error:
                        pass
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
        for p in alive:
            p.kill()
        if seen_out is not None:
            seen_out.update(seen)
    assert not alive, f"processes left running: {alive}"
    assert proc.returncode == 0, stdout + stderr
    r = json.loads(out.read_text())
    left = segment.path_for(r["pool"])
    assert not os.path.exists(left), f"the server left its pool {left}"
    return r, stdout


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:             # gone: its name was cached when it was seen
        return getattr(p, "_name", "") or ""


def _assert_clean(r, requests):
    assert len(r["requests"]) == requests and not r["failed"]
    assert r["leaked_blocks"] == 0 and r["check_violations"] == 0
    stop = r["server_stop"]
    assert stop["server_exit_code"] == 0 and not stop["pool_left"] and not stop["processes_left"]


WORKLOAD = ["--requests", "12", "--workers", "2"]


def outputs(r):
    return {q["id"]: q["outputs"] for q in r["requests"]}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return run_supervisor(tmp_path_factory.mktemp("base"), *WORKLOAD)


@pytest.mark.timeout(300)
def test_a_run_reports_every_key_and_is_clean(baseline):
    r, stdout = baseline
    for k in ("requests", "prefix_hit_rate", "leaked_blocks", "check_violations",
              "worker_restarts", "cow_copies", "evictions", "kv_bytes_in_pool",
              "kv_bytes_without_sharing", "throughput_tokens_per_s", "ttft_cached_s",
              "ttft_uncached_s", "preemptions"):
        assert k in r
    _assert_clean(r, 12)
    # the three questions asked after the workload, answered (random text: the demo model)
    assert [a["question"] for a in r["answers"]] == list(QUESTIONS)
    assert all(a["answer"] for a in r["answers"])
    assert f"Q: {QUESTIONS[0]}" in stdout
    for q in r["requests"]:
        for k in ("id", "worker", "prompt_tokens", "cached_tokens", "outputs", "ttft_s",
                  "preemptions"):
            assert k in q
        assert len(q["outputs"]) == q["n"]
        assert all(0 <= t < 256 for o in q["outputs"] for t in o)   # the demo's byte tokens
        assert q["ttft_s"] > 0
    assert r["outputs_inexact"] == []                # the text maps back to the ids exactly
    assert sum(len(o) for q in r["requests"] for o in q["outputs"]) == r["generated_tokens"]
    assert r["prefix_hit_rate"] > 0                  # the shared system prompt is reused
    assert {q["tenant"] for q in r["requests"]} == {"default", "tenant-b"}
    assert r["ttft_cached_s"]["n"] > 0 and r["ttft_uncached_s"]["n"] > 0
    assert r["worker_restarts"] == 0
    assert 0 < r["kv_bytes_in_pool"] < r["kv_bytes_without_sharing"]
    assert "hit rate" in stdout and "leaked blocks 0" in stdout


@pytest.mark.timeout(300)
def test_killed_workers_are_restarted_and_every_request_completes(baseline, tmp_path):
    r, _ = run_supervisor(tmp_path, *WORKLOAD, "--kill-worker-every", "0.5")
    _assert_clean(r, 12)
    assert r["worker_kills"] >= 1 and r["worker_restarts"] >= 1
    assert outputs(r) == outputs(baseline[0])        # re-runs give the same tokens


@pytest.mark.timeout(300)
def test_without_prefix_cache_nothing_is_shared_and_the_tokens_are_the_same(baseline, tmp_path):
    r, _ = run_supervisor(tmp_path, *WORKLOAD, "--no-prefix-cache")
    _assert_clean(r, 12)
    assert r["prefix_hit_rate"] == 0 and r["ttft_cached_s"]["n"] == 0
    assert outputs(r) == outputs(baseline[0])


@pytest.mark.redis
@pytest.mark.timeout(300)
def test_with_l2_the_report_has_the_pools_l2_counters(baseline, tmp_path):
    """--l2 local: a throwaway redis-server (tools/redis_server.py) for the
    server's L2; every published block is written back, the report and its
    text give the pool's counters (summed over the workers), the tokens are
    the same and the redis-server is gone afterwards."""
    from tools.redis_server import find_redis_server
    if find_redis_server() is None:
        pytest.skip("redis-server not found (apt-get install redis-server)")
    seen = {}
    r, stdout = run_supervisor(tmp_path, *WORKLOAD, "--l2", "local", seen_out=seen)
    _assert_clean(r, 12)
    assert outputs(r) == outputs(baseline[0])
    c = r["l2"]
    assert r["l2_url"].startswith("redis://127.0.0.1:")
    assert c["writes"] > 0 and c["written_bytes"] > 0
    assert c["rejected"] == c["outages"] == c["timeouts"] == 0
    assert f"blocks written {c['writes']}" in stdout and f"L2 {r['l2_url']}" in stdout
    # only the redis-server this run started (a descendant), never another one
    ours = [p for p in seen.values() if _name(p) == "redis-server"]
    assert ours, "the run started no redis-server of its own"
    left = [p.pid for p in ours if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"the run's redis-server was left running: {left}"


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_server_and_leaves_nothing():
    # Its own process group, as a terminal's foreground job. Far more requests
    # than it can serve in the few seconds before the SIGINT (400 finished in time).
    # SIGINT back to its default in the child: a shell without job control
    # starts background commands with SIGINT ignored, and Python then never
    # raises KeyboardInterrupt (the run would go on to the end)
    proc = subprocess.Popen([sys.executable, "-m", "tools.demo", *SMALL,
                             "--requests", "5000"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen, pool = {}, None
    try:
        deadline = time.monotonic() + 90
        while pool is None and time.monotonic() < deadline and proc.poll() is None:
            for p in _descendants(proc.pid):
                seen.setdefault(p.pid, p)
            for p in list(seen.values()):
                name = f"serve-{p.pid}"
                if name in segment.list_names() and len(seen) >= 3:   # server + 2 workers
                    pool = name
            time.sleep(0.2)
        assert pool is not None, "the server never created its pool"
        time.sleep(3.0)                                  # requests in flight
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"the run did not exit within 60 s of the SIGINT; its stderr:\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
        for p in alive:
            p.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not alive, f"processes left running: {alive}"
    assert not os.path.exists(segment.path_for(pool))


def test_bad_flags_are_rejected():
    proc = subprocess.run([sys.executable, "-m", "tools.demo", "--workers", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--workers" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tools.demo", "--l2", "http://h:1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--l2" in proc.stderr and "redis://" in proc.stderr

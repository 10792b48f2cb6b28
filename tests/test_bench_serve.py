"""Smoke tests of ``tools.bench.serve`` (real servers, the demo model, tiny
settings: they check the tool, not the performance): the chat workload runs
on shmcache and on N mlx_lm.servers both round-robin and sticky, every figure
comes out, nothing is left in /dev/shm; and a SIGTERM in the middle of a run
stops every server it started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ("throughput", "ttft_cold_p50", "ttft_cold_p90", "ttft_warm_p50", "ttft_warm_p90",
           "itl_p99", "pss_bytes", "cores_busy")


def _bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "tools.bench.serve", "--model", "demo", "--workers", "2",
            "--rounds", "1", "--max-tokens", "4", "--chat-system-chars", "60",
            "--user-chars", "10-20", *args]


@pytest.mark.timeout(120)
def test_bench_serve_chat_smoke(tmp_path):
    out = tmp_path / "bench.json"
    before = set(os.listdir("/dev/shm"))
    r = subprocess.run(_bench("--workloads", "chat", "--configs", "a,c,c-sticky",
                              "--sessions", "2", "--turns", "2", "--json", str(out)),
                       cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    chat = data["workloads"]["chat"]
    assert set(chat["runs"]) == {"a", "c", "c-sticky"}
    pids = set()
    for name, rounds in chat["runs"].items():
        (rnd,) = rounds
        assert "error" not in rnd, rnd["error"]
        for k in FIGURES:
            assert isinstance(rnd[k], (int, float)) and rnd[k] > 0, (name, k, rnd[k])
        assert rnd["errors"] == 0 and rnd["n_cold"] == 2 and rnd["n_warm"] == 2
        assert rnd["generated_tokens"] > 0 and rnd["shm_left"] == []
        recs = rnd["request_records"]
        assert sorted((x["session"], x["turn"]) for x in recs) == [(0, 0), (0, 1), (1, 0),
                                                                    (1, 1)]
        # a later turn resends the conversation: its prompt is longer than turn 1's
        by = {(x["session"], x["turn"]): x for x in recs}
        assert all(by[(s, 1)]["prompt_tokens"] > by[(s, 0)]["prompt_tokens"] for s in (0, 1))
        if name == "c-sticky":           # a session stays on its server
            assert all(by[(s, 0)]["server"] == by[(s, 1)]["server"] for s in (0, 1))
        pids.update(rnd["server_pids"])
    # later turns found the conversation so far cached (shmcache's pool, sticky servers)
    assert chat["runs"]["a"][0]["cached_tokens_warm"] > 0
    assert chat["runs"]["c-sticky"][0]["cached_tokens_warm"] > 0
    assert chat["ratios"]["c"]["throughput"]["min"] > 0
    assert "target" in chat["ratios"]["c"]["throughput"]
    assert "a / c-sticky" in r.stdout and "TTFT later turns p50" in r.stdout
    assert len(chat["runs"]["c"][0]["commands"]) == 2
    assert "OPENBLAS_NUM_THREADS=1" in chat["runs"]["c"][0]["commands"][0]
    left = [n for n in set(os.listdir("/dev/shm")) - before
            if any(re.search(rf"(?<!\d){p}(?!\d)", n) for p in pids)]
    assert left == []
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in pids)


@pytest.mark.timeout(90)
def test_bench_serve_sigterm_stops_servers():
    p = subprocess.Popen(_bench("--workloads", "unique", "--configs", "c", "--requests", "64",
                                "--max-tokens", "64", "--concurrency", "2"),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stderr:            # wait until the run is under way
            if "running" in line:
                break
        servers = psutil.Process(p.pid).children(recursive=True)
        assert len(servers) >= 2, servers
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        assert p.returncode == 130
        _, alive = psutil.wait_procs(servers, timeout=10)
        assert alive == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_variant_is_a_with_its_flags_and_environment():
    """--variant NAME=ARGS (parsing only; no server): the leading VAR=VALUE
    words go to the server's environment, the rest to its command line, and
    a-NAME becomes a configuration --only accepts; a bad name or an unknown
    configuration is an argument error (exit 2)."""
    from tools.bench import serve
    args = serve.parse_args(["--only", "a,a-p8", "--variant",
                             "p8=OPENBLAS_THREAD_TIMEOUT=9 --pack-rows 8"])
    cfg = serve.make_configs(2, "/lib/blas.so", "balanced", args.variants)["a-p8"]
    assert cfg.kind == "shmcache"
    assert cfg.env == {"SHMCACHE_BLAS": "/lib/blas.so", "OPENBLAS_THREAD_TIMEOUT": "9"}
    assert serve.server_argv(cfg, "m", 1, args)[-2:] == ["--pack-rows", "8"]
    for bad in (["--variant", "bad name=--pack-rows 8"], ["--only", "a-nope"]):
        with pytest.raises(SystemExit) as e:
            serve.parse_args(bad)
        assert e.value.code == 2, bad


def test_the_ratios_are_against_the_first_variant_when_a_did_not_run():
    """serve_report over hand-made rounds (no server): without (a), the
    first a-NAME run is the reference of the paired ratios."""
    from tools.bench import serve_report
    runs = {"a-x": [{"round": 1, "throughput": 30.0}, {"round": 2, "throughput": 33.0}],
            "c": [{"round": 1, "throughput": 20.0}, {"round": 2, "throughput": 22.0}]}
    summ = serve_report.summarize_workload("chat", runs)
    assert summ["reference"] == "a-x"
    assert summ["ratios"]["c"]["throughput"]["rounds"] == [1.5, 1.5]
    assert "a-x / c" in serve_report.report_workload("chat", runs, summ, "two rounds")

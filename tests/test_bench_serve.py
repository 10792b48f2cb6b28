"""Smoke test of ``tools.bench_serve``: both kinds of server start, serve the
workload, report their figures, and leave nothing in /dev/shm. Tiny settings:
this checks the tool, not the performance."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ("throughput", "ttft_cached_p50", "ttft_cached_p90", "ttft_unique_p50",
           "ttft_unique_p90", "pss_bytes")


@pytest.mark.timeout(420)
def test_bench_serve_smoke(tmp_path):
    out = tmp_path / "bench.json"
    before = set(os.listdir("/dev/shm"))
    r = subprocess.run(
        [sys.executable, "-m", "tools.bench_serve", "--workers", "1", "--requests", "4",
         "--rounds", "1", "--only", "a,b", "--max-tokens", "4", "--system-chars", "200",
         "--concurrency", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert set(data["configs"]) == {"a", "b"}
    pids = set()
    for name, cfg in data["configs"].items():
        (rnd,) = cfg["rounds"]
        assert "error" not in rnd, rnd["error"]
        for k in FIGURES:
            assert isinstance(rnd[k], (int, float)) and rnd[k] > 0, (name, k, rnd[k])
        assert rnd["generated_tokens"] > 0 and rnd["errors"] == 0
        assert rnd["commands"] and rnd["shm_left"] == []
        pids.update(rnd["server_pids"])
    # shmcache's prefix cache served the shared-prefix requests
    assert data["configs"]["a"]["rounds"][0]["cached_tokens_shared"] > 0
    assert data["ratios"]["b"]["throughput"]["min"] > 0
    assert "a / b" in r.stdout and "mlx_lm server" in r.stdout
    # no segment of this run's servers is left (others' may come and go meanwhile)
    left = [n for n in set(os.listdir("/dev/shm")) - before
            if any(re.search(rf"(?<!\d){p}(?!\d)", n) for p in pids)]
    assert left == []
    assert not any(n.startswith("shmcache.serve-") and int(n.rsplit("-", 1)[1]) in pids
                   for n in os.listdir("/dev/shm") if n.rsplit("-", 1)[1].isdigit())

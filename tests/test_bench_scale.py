"""tools.bench_scale: a short real run (processes attached by name) gives
every figure, for both mixes, and leaves no pool behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shmcache import segment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_bench_scale_reports_both_mixes(tmp_path):
    before = set(segment.list_names())
    out = tmp_path / "scale.json"
    r = subprocess.run([sys.executable, "-m", "tools.bench_scale", "--processes", "1,2",
                        "--seconds", "0.5", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(x["mix"], x["processes"]) for x in rows] == [
        ("batched", 1), ("batched", 2), ("serving", 1), ("serving", 2)]
    assert all(x["ops_per_s"] > 0 and x["violations"] == 0 for x in rows)
    assert "| batched | 2 |" in r.stdout and "python -m tools.bench_scale" in r.stdout
    assert not [n for n in set(segment.list_names()) - before if n.startswith("bscale-")]

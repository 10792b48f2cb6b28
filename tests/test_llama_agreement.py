"""tools.bench.llama_agreement: the figures it reports, and its refusal
without llama-cpp-python (which is not a dependency; the agreement itself
is reported, not asserted: docs/performance.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.bench.llama_agreement import compare

ROOT = Path(__file__).resolve().parent.parent


def test_compare_counts_top1_agreement_top5_overlap_and_the_margins():
    rng = np.random.default_rng(0)
    ours = rng.normal(size=(4, 12)).astype(np.float32)        # (T, V)
    theirs = ours.copy()
    # position 1: llama.cpp prefers another token by a margin of 0.5 nats
    top = int(np.argmax(ours[1]))
    other = int(np.argsort(-ours[1])[1])
    theirs[1, other] = theirs[1, top] + 0.5
    # position 3: a different order among the top 5 only (top-1 kept)
    order = np.argsort(-ours[3])
    theirs[3, order[4]], theirs[3, order[3]] = ours[3, order[3]], ours[3, order[4]]
    r = compare(ours, theirs)
    assert r["positions"] == 4 and r["top1_agree"] == 3
    assert r["top5_overlap"] == pytest.approx(1.0)
    assert r["disagreement_margins"] == [pytest.approx(0.5, abs=1e-5)]
    # a wholly different distribution: no agreement, and margins for each position
    r = compare(ours, -ours)
    assert r["top1_agree"] == 0 and len(r["disagreement_margins"]) == 4
    assert r["top5_overlap"] < 1.0


@pytest.mark.timeout(60)
def test_without_llama_cpp_it_says_how_to_get_it_and_exits_2():
    # llama_cpp made unimportable in the child (None in sys.modules), whether
    # or not it is installed here
    code = ("import runpy, sys; sys.modules['llama_cpp'] = None; "
            "runpy.run_module('tools.bench.llama_agreement', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "llama_cpp does not import" in lines[0] \
        and "build_llama_cpp_wheel.sh" in lines[0], p.stderr

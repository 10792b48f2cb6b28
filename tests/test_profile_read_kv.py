"""tools/bench/profile_read_kv: the read_kv profile runs on a real pool and cleans up."""

from __future__ import annotations

import os

import pytest

from shmcache.manager import kv as kvmod
from tools.bench import profile_read_kv


@pytest.mark.parametrize("cold", [False, True])
def test_profile_reports_every_row_and_leaves_no_segment(cold):
    before, native = set(os.listdir("/dev/shm")), kvmod._native
    out = profile_read_kv.profile(3, "demo", reps=3, rounds=2, cold=cold)
    want = {"read_kv + eval", "np.copyto, same bytes"}
    if native is not None:
        want.add("numpy path: read_kv + eval")
    assert set(out) == want
    assert all(0 < lo <= med <= hi for med, lo, hi in out.values())
    # (only this process's: other test runs may make and drop segments meanwhile)
    assert {s for s in set(os.listdir("/dev/shm")) - before if f"-{os.getpid()}-" in s} == set()
    assert kvmod._native is native              # put back after timing the numpy path

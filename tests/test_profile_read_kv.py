"""tools/profile_read_kv: the read_kv profile runs on a real pool and cleans up."""

from __future__ import annotations

import os

from shmcache import kv as kvmod
from shmcache import mxbuf
from tools import profile_read_kv


def test_profile_reports_every_piece_and_leaves_no_segment():
    before, native = set(os.listdir("/dev/shm")), mxbuf.native
    out = profile_read_kv.profile(3, "float32")
    want = {"read_kv + eval", "read_kv", "fallback: id check", "fallback: read + eval",
            "np.copyto, same bytes"}
    if mxbuf.native is not None:
        want |= {f"native read_layer, {t}{how}" for t in ("1 thread", "2 threads")
                 for how in ("", ", streamed", ", not streamed")}
    if kvmod._gather is not None:
        want |= {"raw gather, shared arena", "raw gather, private copy"}
    assert set(out) == want
    assert all(v > 0 for v in out.values())
    assert set(os.listdir("/dev/shm")) <= before
    assert mxbuf.native is native              # put back after timing the fallback

"""tools/handoff.c: builds and prints every way of handing off half a copy."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

CC = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(CC is None, reason="no C compiler on this machine")
@pytest.mark.timeout(120)
def test_handoff_builds_and_reports_each_way(tmp_path):
    src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "handoff.c")
    exe = tmp_path / "handoff"
    subprocess.run([CC, "-O2", "-pthread", src, "-o", str(exe)], check=True, timeout=60)
    out = subprocess.run([str(exe), "256"], capture_output=True, text=True, timeout=50,
                         check=True).stdout.splitlines()
    assert out[0] == "256 KiB memcpy, median us"
    ways = [line.rsplit(None, 1) for line in out[1:]]
    assert [w.strip() for w, _ in ways] == [
        "one thread", "a thread started per call", "kept helper, condvar",
        "kept helper, condvar, 2 ms idle", "kept helper, spinning"]
    assert all(float(us) > 0 for _, us in ways)

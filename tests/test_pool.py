"""Pool attachment and liveness across fork."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

CODE = r"""
import os, sys, time, shmcache
m = shmcache.attach(sys.argv[1])
m.get_new_blocks(3)
r, w = os.pipe()
child = os.fork()
if child == 0:          # inherits the manager's descriptors, never uses them
    os.write(w, b"x")   # by now the at-fork handler has dropped its liveness fd
    time.sleep(60)
    os._exit(0)
os.read(r, 1)           # so the parent's death is seen as soon as it happens
print(child, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_keep_a_dead_parent_alive(make_pool):
    mgr = make_pool(max_blocks=16)
    proc = subprocess.Popen([sys.executable, "-c", CODE, mgr.name], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        assert mgr.get_stats().allocated_blocks == 4
        proc.kill()
        proc.wait(10)
        os.kill(child, 0)                      # the child still lives ...
        assert mgr.reclaim_dead() == 3         # ... yet the parent's blocks come back
        assert mgr.check() == [] and mgr.free_blocks == 15
    finally:
        proc.kill()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass

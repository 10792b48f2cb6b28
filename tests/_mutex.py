"""What the mutex tests share (test_mutex, test_mutex_wakeup): the skip for
tests that need the C accelerator, a mapping of a pool's mutex, the seam
that hides the fused C operations, and a holder process driven over stdin.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import pytest

from shmcache.shm import lock as shlock, segment
from shmcache.shm.hot_ops import ReferenceOps

needs_c = pytest.mark.skipif(not shlock.ACCELERATED, reason="shmcache._hot is not built here")


def map_mutex(name):
    fd = os.open(segment.path_for(name), os.O_RDWR)
    try:
        return mmap.mmap(fd, shlock.MUTEX_MAP_SIZE)
    finally:
        os.close(fd)


def python_only(m):
    """Give manager ``m``'s pool the Python reference operations
    (``hot_ops.ReferenceOps``), so that the manager takes its Python paths
    where the C accelerator would run (a unit-test seam, nothing else)."""
    m.pool.ops = ReferenceOps(m.pool.c, m.pool.t_claim)
    return m


HOLDER = textwrap.dedent("""
    import ctypes, mmap, os, sys
    from shmcache.shm import layout as L, lock as shlock, segment
    fd = os.open(segment.path_for(sys.argv[1]), os.O_RDWR)
    mm = mmap.mmap(fd, shlock.MUTEX_MAP_SIZE)
    m = shlock.open_mutex(mm)
    assert m.trylock() == 0
    print("locked", flush=True)
    for cmd in sys.stdin:
        cmd = cmd.strip()
        if cmd == "clear":
            # an unlocker's first half: the word (and owner) cleared, no wake
            ctypes.c_int32.from_buffer(mm, L.MUTEX_OFF + 8).value = 0
            ctypes.c_int32.from_buffer(mm, L.MUTEX_OFF).value = 0
        elif cmd == "unlock":
            m.unlock()
        elif cmd == "exit":
            os._exit(0)
        print("ok", flush=True)
""")


def start_holder(name, pure, **kw):
    env = dict(os.environ)
    env.pop("SHMCACHE_PURE", None)
    if pure:
        env["SHMCACHE_PURE"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, **kw)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def tell(proc, cmd):
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    if cmd != "exit":
        assert proc.stdout.readline().strip() == "ok"


def native_of(mgr, pure):
    if pure:
        python_only(mgr)
        mgr.pool.native = mgr.pool.lock.native = shlock.reference_mutex(mgr.pool.mm)
    return mgr.pool.native

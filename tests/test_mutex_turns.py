"""The turns of the fused C ops at the pool lock (shmcache/_native/hot_enter.h,
take_turn): every turn handed out is handed on, a turn whose holder is gone
(killed waiting, or killed holding the lock) is skipped, and the lock stays
the robust mutex's to give (a dead holder's lock still comes back with the
pool marked dirty, and is repaired). Real processes, hard timeouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shmcache.shm import layout as L

from _mutex import needs_c

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))

pytestmark = [needs_c, pytest.mark.timeout(120)]


def _turns(m):
    return int(m.pool.c[L.C_TURN_NEXT]), int(m.pool.c[L.C_TURN_NOW])


def test_a_turn_nobody_takes_is_skipped_and_the_wait_logged(make_pool):
    """A turn handed out to a process killed before its turn came (here:
    handed out by hand): the op behind it waits TURN_GRACE polls with the
    lock free, skips it, and runs."""
    m = make_pool(max_blocks=16)
    nat = m.pool.native
    m.free_block_batch(m.get_new_blocks(2))
    nxt, now = _turns(m)
    assert nxt == now > 0                           # each op took a turn and handed it on
    m.pool.c[L.C_TURN_NEXT] += 1                      # the dead waiter's turn
    nat.log_waits(True)
    try:
        got = m.get_new_blocks(3)
        waits = nat.take_waits()
    finally:
        nat.log_waits(False)
    assert len(got) == 3 and m.check() == []
    assert len(waits) == 1 and 0 < waits[0] < 10**9, waits
    assert int(m.pool.c[L.C_LOCK_WAIT_NS]) >= waits[0]       # inspect's longest wait
    assert _turns(m) == (nxt + 2, nxt + 2)          # skipped, then handed on
    m.free_block_batch(got)
    assert _turns(m) == (nxt + 3, nxt + 3)


HOLDER = textwrap.dedent("""
    import mmap, os, sys
    import numpy as np
    from shmcache.shm import layout as L, lock as shlock, segment
    fd = os.open(segment.path_for(sys.argv[1]), os.O_RDWR)
    mm = mmap.mmap(fd, os.fstat(fd).st_size)
    c = np.frombuffer(mm, np.int64, L.NUM_COUNTERS, L.HEADER_SIZE)
    turn = int(c[L.C_TURN_NEXT])
    c[L.C_TURN_NEXT] = turn + 1                     # (nobody else runs: the test waits)
    assert int(c[L.C_TURN_NOW]) == turn             # its turn: take the lock, hold it
    assert shlock.open_mutex(mm).trylock() == 0
    c[L.C_DIRTY] = 1                                # mid-update
    print("holding", flush=True)
    sys.stdin.readline()
""")


def test_a_holder_killed_in_its_turn_is_skipped_and_its_update_repaired(make_pool):
    m = make_pool(max_blocks=16)
    held = m.get_new_blocks(2)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, m.name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=ENV)
    try:
        assert proc.stdout.readline().strip() == "holding"
        rec = int(m.pool.c[L.C_RECOVERIES])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        more = m.get_new_blocks(3)                  # skips the dead turn, finds the owner died
        assert len(more) == 3 and m.check() == []
        assert int(m.pool.c[L.C_RECOVERIES]) == rec + 1
        m.free_block_batch(held + more)
        nxt, now = _turns(m)
        assert nxt == now and m.free_blocks == 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


WORKER = textwrap.dedent("""
    import sys, time
    import shmcache
    m = shmcache.attach(sys.argv[1])
    rid, end, n = 0, time.monotonic() + float(sys.argv[2]), 0
    while time.monotonic() < end:
        m.free_block_batch(m.get_new_blocks(2))
        t = m.create_block_table(f"{sys.argv[3]}-{n}")
        m.prepare_append(t, 9)
        m.cache_full_blocks(t.block_ids, list(range(n, n + 9)), 0, 2)
        m.delete_block_table(t.request_id)
        n += 1
    m.close()
    print(n, flush=True)
""")


def test_turns_from_processes_at_once_are_all_handed_on(make_pool):
    m = make_pool(max_blocks=256, max_tables=64)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, m.name, "1.5", f"w{i}"],
                              stdout=subprocess.PIPE, text=True, env=ENV) for i in range(3)]
    try:
        done = [int(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs) and min(done) > 0, done
    nxt, now = _turns(m)
    # five fused ops a round, each a turn (more when an op waits in the
    # kernel and tries again), and none left behind
    assert nxt == now >= 5 * sum(done)
    assert m.check() == [] and m.free_blocks == 255


def test_a_fused_op_beside_a_python_hold_of_its_own_process_needing_the_gil(make_pool):
    """A thread of this process holds the pool lock through the Python path
    and needs the GIL to go on; another thread's fused ops wait for their
    turn and spin with the GIL held, but only for a bounded time, then wait
    for the lock with the GIL released: both finish."""
    m = make_pool(max_blocks=64)
    out = {}

    def hold():
        with m.pool.lock:                              # the Python path: no turn
            end, n = time.monotonic() + 0.3, 0
            while time.monotonic() < end:            # pure Python: it needs the GIL
                n += 1
            out["held"] = n

    def fused():
        k = 0
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            m.free_block_batch(m.get_new_blocks(2))
            k += 1
        out["fused"] = k

    ts = [threading.Thread(target=hold, daemon=True), threading.Thread(target=fused, daemon=True)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in ts), "a thread is stuck"
    assert out["held"] > 0 and out["fused"] > 0
    nxt, now = _turns(m)
    assert nxt == now and m.check() == [] and m.free_blocks == 63

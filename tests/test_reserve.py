"""Per-process block reserves (shmcache/pool/reserve.py, _native/hot_reserve.h):
frees and allocations of a manager with a reserve skip the pool lock, the
blocks count as free, other processes take them when the free list runs
short, and a process that dies or exits gives them back.

The multi-process tests start real processes (``python -c``) that attach
to the pool by name; every wait has a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from shmcache.shm import layout as L
from shmcache.pool import recovery
from shmcache.shm.lock import ACCELERATED

from _helpers import snapshot, unchanged

pytestmark = pytest.mark.skipif(not ACCELERATED, reason="reserves need the C accelerator "
                                "(shmcache._hot); without it set_reserve does nothing")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child that attaches, fills a reserve of 32 blocks, says how many it
# holds, then waits for a command: "alloc N" (prints the ids), "exit".
CHILD = r"""
import sys, shmcache
m = shmcache.attach(sys.argv[1])
m.set_reserve(32)
m.free_block_batch(m.get_new_blocks(32))
print("ready", m.reserve_size, m.pool.slot, flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "alloc":
        print("got", *[b.block_id for b in m.get_new_blocks(int(cmd[1]))], flush=True)
    elif cmd[0] == "exit":
        m.close()
        break
"""


def ops(m) -> int:
    return int(m.pool.c[L.C_OPS])     # lock holds: the reserve's calls take none


@pytest.fixture
def child(pool_name):
    procs = []

    def start(name):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.Popen([sys.executable, "-c", CHILD, name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        return p
    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def readline(p, timeout=30.0) -> list:
    import select
    r, _, _ = select.select([p.stdout], [], [], timeout)
    assert r, "the child did not answer in time"
    return p.stdout.readline().split()


def test_free_and_allocate_through_the_reserve_take_no_lock(manager):
    m = manager
    m.set_reserve(32)
    blocks = m.get_new_blocks(16)
    ids = [b.block_id for b in blocks]
    free, held = m.free_blocks, ops(m)
    m.free_block_batch(blocks)
    assert m.reserve_size == 16 and m.free_blocks == free + 16 and ops(m) == held
    again = m.get_new_blocks(16)
    assert sorted(b.block_id for b in again) == sorted(ids)     # the same blocks back
    assert m.reserve_size == 0 and m.free_blocks == free and ops(m) == held
    assert all(b.ref_count == 1 for b in again)
    m.free_block_batch(again)
    s = m.get_stats()
    assert s.allocated_blocks + s.free_blocks == s.total_blocks and s.free_blocks == m.free_blocks
    assert m.holdings()[0]["loose_blocks"] == 0 and m.holdings()[0]["reserved_blocks"] == 16
    assert m.check() == []


def test_a_double_free_of_a_reserved_block_is_refused_and_changes_nothing(manager):
    m = manager
    m.set_reserve(8)
    b = m.get_new_blocks(2)
    m.free_block_batch(b)
    before = snapshot(m)
    with pytest.raises(ValueError, match="double free"):
        m.free_block_batch([b[0]])
    with pytest.raises(ValueError, match="double free"):
        m.free_block(b[1].block_id)
    unchanged(m, before)
    assert m.reserve_size == 2


def test_blocks_not_held_alone_go_the_locked_way(manager):
    m = manager
    m.set_reserve(8)
    x, y = m.get_new_blocks(2)
    t = m.create_block_table("t")
    m.add_block_to_table(t, y, 1)          # y: the table's now, not a loose reference
    with pytest.raises(ValueError, match="double free"):
        m.free_block(y.block_id)
    m.touch([x])                           # x: held twice
    held = ops(m)
    m.free_block_batch([x])                # 2 -> 1: the lock, nothing reserved
    assert m.reserve_size == 0 and ops(m) == held + 1 and x.ref_count == 1
    m.free_block_batch([x])                # now held alone: into the reserve
    assert m.reserve_size == 1 and ops(m) == held + 1
    assert m.check() == []


def test_referencing_a_reserved_block_takes_it_out(manager):
    m = manager
    m.set_reserve(8)
    b = m.get_new_blocks(4)
    m.free_block_batch(b)
    m.touch([b[0]])
    assert m.reserve_size == 3 and b[0].ref_count == 1
    assert m.check() == []


def test_shrinking_and_bad_sizes(manager):
    m = manager
    m.set_reserve(16)
    m.free_block_batch(m.get_new_blocks(16))
    free = m.free_blocks
    m.set_reserve(4)
    assert m.reserve_size == 4 and m.free_blocks == free
    for bad in (-1, 1.5, True, 1 << 21):
        with pytest.raises(ValueError, match="reserve"):
            m.set_reserve(bad)
    assert m.reserve_size == 4 and m.check() == []


def test_repair_keeps_the_reserve(manager):
    m = manager
    m.set_reserve(16)
    m.free_block_batch(m.get_new_blocks(16))
    with m.pool.lock:
        recovery.repair(m.pool)
        assert recovery.check(m.pool) == []
    assert m.reserve_size == 16
    assert len(m.get_new_blocks(16)) == 16 and m.reserve_size == 0
    assert m.check() == []


@pytest.mark.timeout(60)
def test_another_process_takes_the_reserve_when_the_free_list_runs_short(make_pool, child):
    m = make_pool(block_size=4, max_blocks=64)
    p = child(m.name)
    assert readline(p)[:2] == ["ready", "32"]
    assert m.free_blocks == 63
    mine = m.get_new_blocks(63)            # 31 from the free list, 32 out of the child's reserve
    assert len(mine) == 63 and m.free_blocks == 0 and m.check() == []
    assert [h["reserved_blocks"] for h in m.holdings() if h["slot"] != m.pool.slot] == [0]
    m.free_block_batch(mine[:8])
    p.stdin.write("alloc 8\n")
    p.stdin.flush()
    got = readline(p)
    assert got[0] == "got" and sorted(map(int, got[1:])) == sorted(b.block_id for b in mine[:8])
    assert m.check() == []
    p.stdin.write("exit\n")
    p.stdin.flush()
    assert p.wait(timeout=30) == 0
    m.free_block_batch(mine[8:])
    assert m.free_blocks == 63 and m.check() == []


@pytest.mark.timeout(60)
def test_a_killed_process_gives_its_reserve_back(make_pool, child):
    m = make_pool(block_size=4, max_blocks=64)
    p = child(m.name)
    assert readline(p)[:2] == ["ready", "32"]
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    m.reclaim_dead()
    assert m.free_blocks == 63 and m.check() == []
    assert len(m.get_new_blocks(63)) == 63

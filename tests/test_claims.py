"""Table claims and the append without the pool lock (shmcache/shm/claims.py,
shmcache/_native/hot_claim.h): a one-token append into a table's private
last block takes no lock; anything else goes the locked way; a lock holder
waits for an append in progress and takes over a dead appender's claim;
recovery and check know the claims; a pure process turns the lock-free
appends off while it is attached.

The multi-process tests start real processes (``python -c``) that attach to
the pool by name; every wait has a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import shmcache
from shmcache.shm import claims
from shmcache.shm import layout as L
from shmcache.shm.lock import ACCELERATED

pytestmark = pytest.mark.skipif(not ACCELERATED, reason="the lock-free append needs the C "
                                "accelerator (shmcache._hot)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ops(m) -> int:
    return int(m.pool.c[L.C_OPS])     # lock holds that ended


def consistent(m, t) -> None:
    """The table's token count agrees with its last block's, and check is clean."""
    p, bs = m.pool, m.block_size
    ids = list(t.block_ids)
    tok = t.num_tokens
    assert (len(ids) - 1) * bs < tok <= len(ids) * bs
    assert p.b_tok[ids[-1]] == tok - (len(ids) - 1) * bs
    assert m.check() == []


def test_a_one_token_append_into_the_private_last_block_takes_no_lock(manager):
    m = manager
    t = m.create_block_table("t")
    m.prepare_append(t, 5)                          # blocks of 4: 2 blocks, 3 free slots
    last = t.block_ids[-1]
    total = m.get_memory_usage()["total_tokens_cached"]
    held = ops(m)
    got = [m.prepare_append(t, 1) for _ in range(3)]
    assert ops(m) == held
    assert [[b.block_id for b in g] for g in got] == [[last]] * 3
    assert t.num_tokens == 8 and m.get_memory_usage()["total_tokens_cached"] == total + 3
    consistent(m, t)
    before = ops(m)
    m.prepare_append(t, 1)                          # the last block is full: a new one
    assert ops(m) == before + 1 and len(t.block_ids) == 3
    consistent(m, t)


def test_a_shared_or_published_last_block_goes_the_locked_way(manager):
    m = manager
    t = m.create_block_table("t")
    m.prepare_append(t, 6)
    last = t.block_ids[-1]
    m.touch([last])                                 # held twice: copy-on-write
    held = ops(m)
    (b,) = m.prepare_append(t, 1)
    assert ops(m) > held and b.block_id != last         # the lock, and a copy
    consistent(m, t)
    m.free_block(last)
    u = m.create_block_table("u")
    m.prepare_append(u, 6)
    ids = list(u.block_ids)
    m.pool.b_flags[ids[-1]] |= L.FLAG_CACHED          # published (as a trimmed table's can be)
    try:
        held = ops(m)
        (b,) = m.prepare_append(u, 1)
        assert ops(m) > held and b.block_id != ids[-1]      # the lock, and a copy
    finally:
        m.pool.b_flags[ids[-1]] &= ~L.FLAG_CACHED


def test_another_managers_table_goes_the_locked_way(make_pool):
    a = make_pool(block_size=4, max_blocks=32)
    b = shmcache.attach(a.name)
    try:
        t = a.create_block_table("t")
        a.prepare_append(t, 5)
        tb = b.get_block_table("t")
        held = ops(a)
        b.prepare_append(tb, 1)                     # not its owner: the lock
        assert ops(a) == held + 1 and t.num_tokens == 6
        consistent(a, t)
    finally:
        b.close()


def test_a_claim_held_by_the_lock_holder_turns_the_lock_free_append_off(manager):
    m = manager
    p = m.pool
    t = m.create_block_table("t")
    m.prepare_append(t, 5)
    p.t_claim[t.internals.table] = -1                            # as a hold that writes the table has it
    held = ops(m)
    try:
        assert p.native.append(t.internals.table, t.internals.rid_hash, 1, 4, 0.0, p.slot, m.internals.holder.epoch) is None
        assert ops(m) == held + 1                   # it went for the lock, and refused
        assert t.num_tokens == 5
    finally:
        p.t_claim[t.internals.table] = 0
    with p.lock:
        m.internals.tables.table_index(t)                           # a Python hold takes the claim...
        assert p.t_claim[t.internals.table] == -1 and p.lock.claimed == [t.internals.table]
    assert p.t_claim[t.internals.table] == 0 and p.lock.claimed == []    # ...and gives it back


def test_a_lock_holder_waits_for_a_live_appender_and_takes_a_dead_ones_claim(make_pool):
    a = make_pool(block_size=4, max_blocks=32)
    other = shmcache.attach(a.name)                 # a live slot (its liveness byte held)
    p = a.pool
    try:
        t = a.create_block_table("t")
        a.prepare_append(t, 5)
        p.t_claim[t.internals.table] = other.pool.slot + 1         # as if it were appending now
        let_go = threading.Timer(0.3, lambda: p.t_claim.__setitem__(t.internals.table, 0))
        let_go.start()
        t0 = time.monotonic()
        a.trim_table(t, 1)                          # waits for the claim
        assert time.monotonic() - t0 >= 0.25 and t.num_tokens == 4
        let_go.join()
        # a slot that is not attached (a dead appender's, reclaimed): taken over
        dead = other.pool.slot
        other.close()
        p.t_claim[t.internals.table] = dead + 1
        assert any("claimed by slot" in x for x in a.check())
        a.trim_table(t, 1)
        assert t.num_tokens == 3 and p.t_claim[t.internals.table] == 0 and a.check() == []
    finally:
        if not other.pool.closed:
            other.close()


def test_repair_gives_back_a_dead_lock_holders_claims(manager):
    m = manager
    p = m.pool
    t = m.create_block_table("t")
    m.prepare_append(t, 5)
    p.t_claim[t.internals.table] = -1                            # left by a holder that died
    assert any("lock holder that is gone" in x for x in m.check())
    with p.lock:
        m.pool._on_dirty()
    assert p.t_claim[t.internals.table] == 0 and m.check() == []
    m.prepare_append(t, 1)
    consistent(m, t)


def test_free_records_with_a_claim_are_not_reused(manager):
    m = manager
    p = m.pool
    p.t_claim[0] = 5                                # a stale probe on a free record
    try:
        t = m.create_block_table("t")
        assert t.internals.table != 0
        with p.lock:
            assert m.internals.tables.new_table("u") != 0
    finally:
        p.t_claim[0] = 0


# ------------------------------------------------------------ processes

APPENDER = r"""
import sys, shmcache
m = shmcache.attach(sys.argv[1])
t = m.create_block_table(sys.argv[2])
m.prepare_append(t, 1)
print("ready", flush=True)
n = 1
while n < int(sys.argv[3]):
    m.prepare_append(t, 1)
    n += 1
print("done", n, flush=True)
sys.stdin.readline()
m.close()
"""


def _start(code, *args, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=e)


def _line(p, timeout=60.0) -> list:
    import select
    r, _, _ = select.select([p.stdout], [], [], timeout)
    assert r, "the child did not answer in time"
    return p.stdout.readline().split()


@pytest.mark.timeout(120)
def test_an_owners_lock_free_appends_and_anothers_locked_ops_on_one_table_lose_nothing(
        make_pool):
    """The owner appends 20,000 tokens one at a time (mostly without the lock)
    while this process appends and trims the same table by name under the
    lock, as fast as it can: every token is counted once, and the table and
    its last block agree."""
    a = make_pool(block_size=16, max_blocks=4096, max_tables=64)
    n = 20000
    p = _start(APPENDER, a.name, "shared", n)
    try:
        assert _line(p) == ["ready"]
        t = a.get_block_table("shared")
        mine = 0
        while p.poll() is None:
            a.prepare_append(t, 3)
            a.trim_table(t, 1)
            mine += 2
            import select
            if select.select([p.stdout], [], [], 0)[0]:
                break
        assert _line(p) == ["done", str(n)]
        assert t.num_tokens == n + mine
        consistent(a, t)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert a.get_block_table("shared") is None and a.check() == []
    assert a.get_stats().free_blocks == a.max_blocks - 1


@pytest.mark.timeout(180)
def test_appenders_killed_at_any_moment_lose_nothing(make_pool):
    """Processes appending without the lock are SIGKILLed at random moments;
    their tables are released whole, no claim stays behind, and the pool
    checks clean."""
    import random
    a = make_pool(block_size=16, max_blocks=4096, max_tables=64)
    rng = random.Random(7)
    for k in range(8):
        p = _start(APPENDER, a.name, f"k{k}", 10 ** 9)
        try:
            assert _line(p) == ["ready"]
            time.sleep(rng.uniform(0.05, 0.3))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
    a.reclaim_dead()
    assert not (a.pool.tables["claim"] != 0).any()
    assert a.check() == [] and a.get_stats().free_blocks == a.max_blocks - 1


@pytest.mark.timeout(120)
def test_a_pure_process_turns_the_lock_free_append_off_while_attached(make_pool):
    a = make_pool(block_size=4, max_blocks=32)
    t = a.create_block_table("t")
    a.prepare_append(t, 5)
    pure = _start("import sys, shmcache\nm = shmcache.attach(sys.argv[1])\n"
                  "print('ready', flush=True)\nsys.stdin.readline()\n", a.name,
                  env={"SHMCACHE_PURE": "1"})
    try:
        assert _line(pure) == ["ready"]
        assert a.pool.c[L.C_PURE] == 1 and claims.count_pure(a.pool) == 1
        held = ops(a)
        a.prepare_append(t, 1)
        assert ops(a) == held + 1                   # the lock
        pure.send_signal(signal.SIGKILL)
        pure.wait(timeout=10)
        a.reclaim_dead()                                 # its slot released: no longer counted
        assert a.pool.c[L.C_PURE] == 0
        held = ops(a)
        a.prepare_append(t, 1)
        assert ops(a) == held and t.num_tokens == 7
        assert a.check() == []
    finally:
        if pure.poll() is None:
            pure.kill()
            pure.wait(timeout=10)

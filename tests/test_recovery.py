"""Processes that die in the middle of an update under the pool lock, and
records found corrupt: the repair (``shmcache.pool.recovery``) that whoever takes
the lock next runs.

Workers are ``tests/_proc_server.py`` started with ``subprocess.Popen``
(independent processes attaching by name). Every wait has a timeout; every
worker is killed in teardown; pools are destroyed by ``make_pool``. What the
dead held and its release (and SIGKILLs at random moments) are in
``test_reclaim.py``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import segment

from _deaths import (BLOCKED_BOUND, BS, LAYOUT, dead_entries, lock_is_held_elsewhere, publish,
                     ref_counts)
from _proc_client import family_tokens, verify_blocks, wait_for_lock_waiter
from _proc_server import SCRIBBLES


# ------------------------------------------------------- death mid-update
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SCRIBBLES)
def test_killed_mid_update_under_the_lock(make_pool, spawn, kind):
    mgr = make_pool(max_blocks=32, **LAYOUT)
    tokens = family_tokens(1, 3 * BS)
    rid, pub = publish(mgr, tokens)
    mgr.delete_block_table(rid)                      # cached and free: the index must survive
    mine = mgr.get_new_blocks(2)
    mt = mgr.create_block_table("mine")
    mgr.add_block_to_table(mt, mine[0], BS)
    before = ref_counts(mgr)
    free_before = mgr.free_blocks

    w = spawn("serve", mgr.name)
    w.ready()
    blocks = w.call("alloc", n=3)
    w.call("create", rid="victim")
    w.call("add", rid="victim", block=blocks[0], tokens=BS)
    w.call("add", rid="victim", block=blocks[1], tokens=2)
    w.call("scribble", kind=kind)
    assert lock_is_held_elsewhere(mgr)
    assert mgr.pool.c[L.C_DIRTY] == 1
    recoveries = mgr.pool.c[L.C_RECOVERIES]

    # A second process and our own thread wait on the lock while it is held.
    path = segment.path_for(mgr.name)
    waiter = spawn("serve", mgr.name)            # its attach needs the lock
    th_result = {}
    th = threading.Thread(target=lambda: th_result.setdefault("b", mgr.allocate_block().block_id),
                          daemon=True)
    th.start()
    wait_for_lock_waiter(path, os.getpid())
    wait_for_lock_waiter(path, waiter.pid)
    t_kill = time.monotonic()
    w.kill()
    th.join(timeout=10)
    assert not th.is_alive(), "the parent stayed blocked after the lock holder died"
    assert time.monotonic() - t_kill < BLOCKED_BOUND
    waiter.ready(timeout=30)                         # attached after the death, not blocked
    assert waiter.call("stats", timeout=10)["total_blocks"] == 32

    assert mgr.pool.c[L.C_DIRTY] == 0
    assert mgr.pool.c[L.C_RECOVERIES] == recoveries + 1
    assert mgr.check() == []
    assert dead_entries(mgr) == []
    # The dead one's 3 blocks (2 in its table, 1 loose) were released by the
    # repair our allocate ran; reclaim_dead reports them.
    assert mgr.reclaim_dead() == 3
    assert mgr.reclaim_dead() == 0
    mgr.free_block(th_result["b"])
    assert (ref_counts(mgr) == before).all()
    assert mgr.free_blocks == free_before
    assert mgr.get_block_table("mine").block_ids == [mine[0].block_id]
    # the cached chain is still found, with its payload
    got, n = mgr.acquire_computed_blocks(tokens)
    assert [b.block_id for b in got] == pub and n == 3 * BS
    verify_blocks(mgr, pub, tokens, 0, "cached chain after repair")
    mgr.free_block_batch(got)
    waiter.stop()
    assert waiter.wait(timeout=30) == 0


@pytest.mark.timeout(60)
def test_first_to_lock_after_death_is_a_new_attacher(make_pool, spawn):
    """A manager attaching right after the death takes the lock first (to get
    its slot) before it can repair; the pool must still get repaired."""
    mgr = make_pool(max_blocks=16, **LAYOUT)
    w = spawn("serve", mgr.name)
    w.ready()
    w.call("alloc", n=2)
    w.call("scribble", kind="pop_free")
    w.kill()
    other = shmcache.attach(mgr.name)
    try:
        assert other.check() == []
        assert other.reclaim_dead() == 2
        assert mgr.check() == []
        assert mgr.free_blocks == 15
    finally:
        other.close()
    # and a new process attaching first
    w2 = spawn("serve", mgr.name)
    w2.ready()
    w2.call("alloc", n=1)
    w2.call("scribble", kind="half_unlink")
    w2.kill()
    w3 = spawn("serve", mgr.name)
    w3.ready()
    assert w3.call("check") == []
    assert w3.call("reclaim") == 1
    w3.stop()
    assert w3.wait(timeout=30) == 0
    assert mgr.check() == [] and mgr.free_blocks == 15


@pytest.mark.timeout(60)
def test_killed_holding_the_lock_blocks_nobody(make_pool, spawn):
    """A plain lock holder (no scribble) killed: waiters in two other processes proceed."""
    mgr = make_pool(max_blocks=16, **LAYOUT)
    holder = spawn("serve", mgr.name)
    a = spawn("serve", mgr.name)
    b = spawn("serve", mgr.name)
    for w in (holder, a, b):
        w.ready()
    holder.call("alloc", n=1)
    reclaimed0 = mgr.pool.c[L.C_RECLAIMED]
    assert holder.call("lock_enter") is True
    a.request("alloc", n=2)
    b.request("stats")
    path = segment.path_for(mgr.name)
    wait_for_lock_waiter(path, a.pid)
    wait_for_lock_waiter(path, b.pid)
    t0 = time.monotonic()
    holder.kill()
    assert len(a.result(timeout=10)) == 2
    b.result(timeout=10)
    assert time.monotonic() - t0 < BLOCKED_BOUND
    assert mgr.check() == []
    # whoever took the lock first repaired the pool and released the dead one's block
    mgr.reclaim_dead()
    assert dead_entries(mgr) == []
    assert mgr.pool.c[L.C_RECLAIMED] == reclaimed0 + 1
    assert mgr.free_blocks == 15 - 2
    for w in (a, b):
        w.stop()
        assert w.wait(timeout=30) == 0
    assert mgr.check() == [] and mgr.free_blocks == 15


def _slot_of(mgr, pid: int) -> int:
    slots = [h["slot"] for h in mgr.holdings() if h["pid"] == pid]
    assert len(slots) == 1, f"pid {pid} holds slots {slots}"
    return slots[0]


@pytest.mark.timeout(60)
def test_a_repairer_killed_in_its_hold_is_the_holder_waited_for(make_pool, spawn):
    """A process repairs, then dies in the same hold; the slot of the holder
    it repaired after is reused by a new process. The next repair must wait
    for the repairer's liveness byte, not that live slot's (it once waited
    its whole 2 s timeout: a stall of every process, seen under kills)."""
    mgr = make_pool(max_blocks=16, **LAYOUT)
    p1 = spawn("serve", mgr.name)
    p1.ready()
    s1 = _slot_of(mgr, p1.pid)
    assert p1.call("lock_enter") is True             # holds the lock, the pool dirty
    p1.kill()
    p2 = spawn("serve", mgr.name)                    # attaches: cannot repair yet
    p2.ready()
    s2 = _slot_of(mgr, p2.pid)
    assert p2.call("lock_enter") is True             # repairs, frees s1, keeps the lock
    assert mgr.pool.c[L.C_DIRTY] == 1
    assert mgr.pool.c[L.C_HOLDER] == s2, "the repairer did not name itself the holder"
    p2.kill()
    p3 = spawn("serve", mgr.name)                    # attaches into the freed slot s1
    p3.ready()
    assert _slot_of(mgr, p3.pid) == s1, "setup: the new process did not take s1"
    t0 = time.monotonic()
    b = mgr.allocate_block()                         # the parent repairs
    waited = time.monotonic() - t0
    assert waited < 1.0, f"the repair waited {waited:.2f} s on a live slot"
    assert mgr.check() == []
    mgr.free_block(b)
    mgr.reclaim_dead()
    assert dead_entries(mgr) == []
    p3.stop()
    assert p3.wait(timeout=30) == 0
    assert mgr.check() == [] and mgr.free_blocks == 15


# ------------------------------------------------------------ corrupt records
def test_repair_cuts_a_list_at_an_id_naming_no_block(manager):
    """Recovery walks every list bounded: a table is cut before the first id
    naming no block (or a link out of range, or a chunk met before), a loose
    list keeps its good ids: the lists are the truth only as far as they
    make sense."""
    from shmcache.shm import layout as L
    p = manager.pool
    t = manager.create_block_table("a")
    manager.prepare_append(t, 12)                   # three blocks
    loose = manager.get_new_blocks(2)
    words = manager.internals.holder.refs.table_words(manager.internals.tables.table_index(t))
    p.kw[words[1]] = 10**6                          # names no block
    p.kw[manager.internals.holder.refs.loose.top(loose[0].block_id)] = -3
    p.c[L.C_DIRTY] = 1                              # as a holder dying mid-update leaves it
    assert manager.check() == []                    # repaired on taking the lock
    assert len(t.block_ids) == 1 and manager.pool.s_count[p.slot] == 1
    assert manager.free_blocks == 31 - 2
    manager.free_block(loose[-1].block_id)          # the one left in the loose list
    manager.delete_block_table("a")
    assert manager.free_blocks == 31 and manager.check() == []


def test_repair_after_a_cycle_and_a_shared_chunk(manager):
    from shmcache.shm import layout as L
    p = manager.pool
    a = manager.create_block_table("a")
    manager.prepare_append(a, 4 * 20)               # twenty blocks: two chunks
    b = manager.fork_block_table(a, "b")
    ha, hb = p.t_head[manager.internals.tables.table_index(a)], p.t_head[manager.internals.tables.table_index(b)]
    p.kw[ha * L.CHUNK_WORDS] = ha                   # a's first chunk links to itself
    p.t_head[manager.internals.tables.table_index(b)] = ha          # and b starts there too
    p.c[L.C_DIRTY] = 1
    assert manager.check() == []
    assert len(a.block_ids) == 15 and len(b.block_ids) == 0
    manager.delete_block_table("a")
    manager.delete_block_table("b")
    assert manager.free_blocks == 31 and manager.check() == []
    assert hb >= 0


def test_an_operation_meeting_a_corrupt_list_raises_then_the_pool_is_whole(manager):
    from shmcache.shm import layout as L
    from shmcache.errors import CorruptPoolError
    p = manager.pool
    t = manager.create_block_table("a")
    manager.prepare_append(t, 4 * 20)               # two chunks
    head = p.t_head[manager.internals.tables.table_index(t)]
    p.kw[head * L.CHUNK_WORDS] = head               # a cycle: walked forever before
    with pytest.raises(CorruptPoolError, match="table 0's list") as ei:
        manager.fork_block_table(t, "b")
    assert "rebuilt" in str(ei.value)
    assert manager.check() == []                    # rebuilt from the records
    manager.fork_block_table(t, "b")                # and the call works again
    assert manager.request_tables["b"].block_ids == t.block_ids

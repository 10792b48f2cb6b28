"""The pool mutex (shmcache.shm.lock, shmcache.system.platform_linux,
shmcache/_native/hot_mutex.h) and the C fast paths.

The C accelerator and the ctypes fallback drive the same robust mutex, so
they must exclude each other across processes; a holder's death must hand
the lock on and mark the pool dirty; and the fused C allocate/free must
leave exactly the state the Python fast path (fastpath.py) leaves.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import lock as shlock, segment

from _helpers import LOCK_COUNTERS
from _mutex import map_mutex, needs_c, python_only
from _proc_client import lock_is_busy, wait_for_lock_waiter


@pytest.mark.parametrize("pure", [False, True], ids=["c", "ctypes"])
@pytest.mark.timeout(60)
def test_the_two_implementations_exclude_each_other_across_processes(make_pool, spawn, pure):
    if not shlock.ACCELERATED and not pure:
        pytest.skip("shmcache._hot is not built here")
    mgr = make_pool(max_blocks=16)
    # the child uses the other implementation than this process's manager
    child = spawn("serve", mgr.name, env={"SHMCACHE_PURE": "1"} if not pure else {})
    child.ready()
    if not pure:
        assert child.call("native") == "RobustMutex"
        assert type(mgr.pool.native).__name__ == "Hot"
    else:
        python_only(mgr)
        mgr.pool.native = mgr.pool.lock.native = shlock.reference_mutex(mgr.pool.mm)
    assert child.call("lock_enter") is True
    assert lock_is_busy(segment.path_for(mgr.name))
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("b", mgr.allocate_block().block_id),
                          daemon=True)
    th.start()
    wait_for_lock_waiter(segment.path_for(mgr.name), os.getpid())
    child_blocks = child.call("alloc", n=2)     # under the lock the child holds
    assert "b" not in got
    child.call("lock_exit")
    th.join(timeout=20)
    assert not th.is_alive()
    assert got["b"] not in child_blocks
    assert mgr.check() == []
    child.call("free", ids=child_blocks)
    mgr.free_block(got["b"])
    child.stop()
    assert child.wait(timeout=30) == 0


@pytest.mark.parametrize("pure", [False, True], ids=["c", "ctypes"])
@pytest.mark.timeout(60)
def test_a_dead_holder_hands_the_lock_on_and_marks_the_pool_dirty(make_pool, pure):
    if not shlock.ACCELERATED and not pure:
        pytest.skip("shmcache._hot is not built here")
    mgr = make_pool(max_blocks=16)
    held = mgr.get_new_blocks(2)
    code = textwrap.dedent(f"""
        import mmap, os, sys
        from shmcache.shm import lock as shlock, segment
        fd = os.open(segment.path_for({mgr.name!r}), os.O_RDWR)
        mm = mmap.mmap(fd, shlock.MUTEX_MAP_SIZE)
        m = shlock.open_mutex(mm)
        assert m.trylock() == 0
        print("locked", flush=True)
        sys.stdin.readline()
        os._exit(0)          # dies holding it
    """)
    env = dict(os.environ)
    env.pop("SHMCACHE_PURE", None)
    if pure:
        env["SHMCACHE_PURE"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert lock_is_busy(segment.path_for(mgr.name))
        assert mgr.pool.c[L.C_DIRTY] == 0
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    mm = map_mutex(mgr.name)
    m = shlock.open_mutex(mm) if not pure else shlock.reference_mutex(mm)
    try:
        assert m.trylock() == 1                 # taken from the dead holder
        assert mgr.pool.c[L.C_DIRTY] == 1         # ... and the pool marked for repair
        m.unlock()
        assert m.trylock() == 0                 # consistent again
        m.unlock()
    finally:
        m.release()
        mm.close()
    recoveries = mgr.pool.c[L.C_RECOVERIES]
    assert mgr.allocate_block() is not None    # the next holder repairs
    assert mgr.pool.c[L.C_RECOVERIES] == recoveries + 1
    assert mgr.pool.c[L.C_DIRTY] == 0 and mgr.check() == []
    assert [b.ref_count for b in held] == [1, 1]


@needs_c
def test_a_self_deadlock_raises_instead_of_hanging(make_pool):
    mgr = make_pool()
    with mgr.pool.lock:
        assert mgr.pool.native.trylock() == -1    # error-checking: never taken twice
        with pytest.raises(OSError) as e:
            mgr.pool.native.lock()
        assert e.value.errno == __import__("errno").EDEADLK


@needs_c
def test_released_mapping_is_refused_not_touched(make_pool):
    mgr = make_pool()
    h = shlock.open_hot(mgr.pool.mm, mgr.pool.layout, mgr.pool.created_at)
    h.release()
    with pytest.raises(ValueError, match="released"):
        h.trylock()
    with pytest.raises(ValueError, match="released"):
        h.alloc(1, mgr.pool.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf)


def _state(m):
    """Everything the fused paths touch, minus what differs between two pools
    by construction (seeds, times, lock bookkeeping)."""
    p = m.pool
    b = p.blocks
    c = p.counter_array.copy()
    c[LOCK_COUNTERS] = 0
    return (b["ref_count"].tobytes(), b["prev"].tobytes(), b["next"].tobytes(),
            b["flags"].tobytes(), b["token_count"].tobytes(), b["gen"].tobytes(),
            p.chunks.tobytes(),
            p.slots["loose_head"].tobytes(), p.slots["loose_count"].tobytes(), c.tobytes(),
            m.internals.holder.refs.loose.buf.tobytes())


def _drive(m, seed: int) -> list:
    """A random scheduler's mix: single and batched allocate/free, errors,
    and cached blocks (which send allocation down the slow path)."""
    rng = random.Random(seed)
    held, log = [], []
    for step in range(1500):
        op = rng.random()
        if op < 0.25:
            b = m.allocate_block()
            log.append(("a", None if b is None else b.block_id))
            if b is not None:
                held.append(b.block_id)
        elif op < 0.45:
            try:
                got = m.get_new_blocks(rng.randint(1, 12))
            except ValueError:
                log.append(("g", "full"))
                continue
            log.append(("g", [b.block_id for b in got]))
            held += [b.block_id for b in got]
        elif op < 0.6 and held:
            b = held.pop(rng.randrange(len(held)))
            log.append(("f", m.free_block(b)))
        elif op < 0.8 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            batch = held[:k]
            if rng.random() < 0.15:
                # a double free: it raises and nothing changes
                with pytest.raises(ValueError):
                    m.free_block_batch(batch + [batch[0]])
                log.append(("F", "double"))
                continue
            m.free_block_batch(batch)
            held = held[k:]
            log.append(("F", len(batch)))
        elif op < 0.9 and held:
            b = held[rng.randrange(len(held))]
            tok = [rng.randrange(100) for _ in range(m.block_size)]
            m.cache_full_blocks([m.blocks[b]], tok, 0, 1, extra_keys=(f"t{step}",))
            log.append(("c", b))
        else:
            b = rng.randrange(1, m.max_blocks)
            if b in held:
                held.remove(b)
                log.append(("x", m.free_block(b)))
            elif m.pool.b_ref[b] == 0:
                log.append(("x", m.free_block(b)))      # unknown block: False
    for b in held:
        m.free_block(b)
    return log


@needs_c
def test_the_c_fast_paths_leave_the_same_state_as_the_python_ones():
    a = shmcache.PagedCacheManager(block_size=4, max_blocks=48)
    b = python_only(shmcache.PagedCacheManager(block_size=4, max_blocks=48))
    try:
        b.internals.ledger.root = a.internals.ledger.root                        # same chain hashes in both
        for seed in range(4):
            la, lb = _drive(a, seed), _drive(b, seed)
            assert la == lb
            assert _state(a) == _state(b)
            assert a.check() == [] and b.check() == []
        assert a.pool.c[L.C_OPS] > 0 and b.pool.c[L.C_OPS] > 0
    finally:
        a.close()
        b.close()


@needs_c
def test_the_c_fast_path_refuses_a_stale_view_and_a_dirty_pool(make_pool):
    mgr = make_pool(max_blocks=16)
    nat, p = mgr.pool.native, mgr.pool
    before = p.counter_array.copy()
    assert nat.alloc(1, p.slot, mgr.internals.holder.epoch + 1, mgr.internals.holder.refs.loose.buf) is None   # stale epoch
    p.c[L.C_DIRTY] = 1
    assert nat.alloc(1, p.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf) is None       # dirty
    assert nat.free([1], p.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf) is None
    p.c[L.C_DIRTY] = 0
    after = p.counter_array.copy()
    for c in (L.C_OPS, L.C_TURN_NEXT, L.C_TURN_NOW):    # (the holds' bookkeeping)
        before[c] = after[c] = 0
    assert (before == after).all() and len(mgr.internals.holder.refs.loose) == 0
    # not held loose (as many times as listed): None, and nothing changes
    got = nat.alloc(2, p.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf)
    assert len(got) == 2 and mgr.internals.holder.refs.loose.blocks() == sorted(got)
    for bad in ([got[0], got[0]], [got[0], 0], [got[0], 99], [got[0], True], [got[0], 7]):
        assert nat.free(bad, p.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf) is None, bad
    assert mgr.check() == [] and mgr.internals.holder.refs.loose.blocks() == sorted(got)
    assert nat.free(got, p.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf) == 2
    assert len(mgr.internals.holder.refs.loose) == 0 and mgr.free_blocks == 15 and mgr.check() == []

"""The pool lock: a failed repair never keeps the lock; threads of one
process share a manager; closing a manager makes its lock unusable before it
lets go of it; a finalizer never waits on a lock its own thread holds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import segment

from _proc_client import lock_is_busy


def test_a_repair_that_raises_releases_the_lock_and_leaves_the_pool_dirty(make_pool, monkeypatch):
    from shmcache.pool import recovery
    owner = make_pool()
    other = shmcache.attach(owner.name)
    try:
        owner.pool.c[L.C_DIRTY] = 1           # as if a holder died mid-update
        real = recovery.repair

        def broken(p):
            if p is other.pool:
                raise RuntimeError("repair failed")
            real(p)
        monkeypatch.setattr(recovery, "repair", broken)
        with pytest.raises(RuntimeError, match="repair failed"):
            other.allocate_block()
        assert other.pool.c[L.C_DIRTY] == 1  # the next holder must repair
        assert not lock_is_busy(segment.path_for(owner.name))   # nobody holds it now
        assert owner.allocate_block() is not None   # owner repairs and goes on
        assert owner.pool.c[L.C_DIRTY] == 0 and owner.check() == []
        assert owner.pool.c[L.C_RECOVERIES] >= 1
    finally:
        other.close()


@pytest.mark.timeout(60)
def test_threads_of_one_process_share_a_manager(make_pool):
    import random
    mgr = make_pool(max_blocks=64)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for i in range(300):
                bs = mgr.get_new_blocks(rng.randint(1, 3))
                t = mgr.create_block_table(f"t{seed}-{i}")
                for b in bs:
                    mgr.add_block_to_table(t, b, 4)
                toks = [rng.randrange(8) for _ in range(4 * len(bs))]
                mgr.cache_full_blocks(t.block_ids, toks, 0, len(bs))
                got, n = mgr.acquire_computed_blocks(toks)
                mgr.free_block_batch(got)
                mgr.prepare_append(mgr.fork_block_table(t, f"f{seed}-{i}"), 1)
                mgr.delete_block_table(f"f{seed}-{i}")
                mgr.delete_block_table(t.request_id)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)      # switch threads often, inside operations too
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert mgr.check() == []
    assert mgr.free_blocks == mgr.max_blocks - 1 and len(mgr.request_tables) == 0


# ------------------------------------------------------- closing under the lock
def _widen_close_window(m):
    """Make the (real, tiny) window between close's lock release and
    unmap() long enough to hit deterministically; returns the event set
    when the window opens."""
    p = m.pool
    orig = p.unmap
    opened = threading.Event()

    def slow_unmap():
        opened.set()
        time.sleep(0.3)
        orig()

    p.unmap = slow_unmap
    return opened


def test_thread_waiting_on_lock_during_close_does_not_run_slotless(make_pool):
    """Regression (review of the core library): close() of a manager shared
    by threads released the pool lock (slot already -1) before marking the
    pool unusable: a thread waiting for the lock then ran its operation with
    slot -1, i.e. on the pool's LAST slot."""
    creator = make_pool(max_slots=4)
    m = shmcache.attach(creator.name)
    opened = _widen_close_window(m)
    out = {}

    def worker():
        opened.wait()
        try:
            out["block"] = m.allocate_block()
        except shmcache.PoolClosedError as e:
            out["error"] = e

    th = threading.Thread(target=worker)
    th.start()
    m.close()
    th.join()
    assert "block" not in out          # it ran with slot -1 before the fix
    assert isinstance(out.get("error"), shmcache.PoolClosedError)
    assert creator.check() == []
    assert creator.free_blocks == creator.max_blocks - 1


def test_concurrent_close_does_not_release_the_last_slot(make_pool):
    """Regression (review of the core library), the same window: a second
    close() waiting for the lock released slot -1, another manager's slot."""
    creator = make_pool(max_slots=3)                 # slot 0
    m = shmcache.attach(creator.name)                # slot 1
    victim = shmcache.attach(creator.name)           # slot 2 == slot -1
    assert victim.pool.slot == 2
    held = victim.get_new_blocks(3)
    opened = _widen_close_window(m)
    errors = []

    def second_close():
        opened.wait()
        try:
            m.close()
        except Exception as e:      # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=second_close)
    th.start()
    m.close()
    th.join()
    assert errors == []
    assert creator.check() == []
    # before the fix the second close popped slot -1: the victim's references
    assert all(b.ref_count == 1 for b in held)
    assert victim.holdings()[-1]["loose_blocks"] == 3
    victim.free_block_batch(held)
    victim.close()


def test_finalizer_inside_another_managers_lock_does_not_deadlock(pool_name):
    """Regression (review of the core library): the GC finalizer of a manager
    dropped without close() took the pool lock through its own file
    description; run by the cyclic GC inside an operation of another manager
    of the same pool in the same thread, it waited on that thread's own lock
    forever. Now it leaves as a death would, and reclaim releases its block."""
    code = textwrap.dedent(f"""
        import gc, shmcache
        creator = shmcache.create_pool({pool_name!r}, block_size=4, max_blocks=16)
        try:
            other = shmcache.attach({pool_name!r})
            other.allocate_block()
            other.cycle = other        # a reference cycle: only the cyclic GC collects it
            del other
            with creator.pool.lock:      # as inside any op of creator
                gc.collect()
            assert creator.check() == [], creator.check()
            assert creator.reclaim_dead() == 1
            assert creator.free_blocks == 15
            assert creator.check() == []
            print("done")
        finally:
            creator.destroy()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the finalizer deadlocked on this thread's own pool lock") from None
    assert proc.returncode == 0, err
    assert "done" in out

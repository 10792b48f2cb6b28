"""Regressions found in review of the core library.

1. close() of a manager shared by threads released the pool lock (slot
   already -1) before marking the pool unusable: a thread waiting for the
   lock then ran its operation with slot -1, i.e. on the pool's LAST slot.
2. The GC finalizer of a manager dropped without close() took the pool lock
   through its own file description; run by the cyclic GC inside an
   operation of another manager of the same pool in the same thread, it
   waited on that thread's own flock forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import shmcache


def _widen_close_window(m):
    """Make the (real, tiny) window between _close's lock release and
    unmap() long enough to hit deterministically; returns the event set
    when the window opens."""
    p = m._p
    orig = p.unmap
    opened = threading.Event()

    def slow_unmap():
        opened.set()
        time.sleep(0.3)
        orig()

    p.unmap = slow_unmap
    return opened


def test_thread_waiting_on_lock_during_close_does_not_run_slotless(make_pool):
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
    creator = make_pool(max_slots=3)                 # slot 0
    m = shmcache.attach(creator.name)                # slot 1
    victim = shmcache.attach(creator.name)           # slot 2 == slot -1
    assert victim._p.slot == 2
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
    code = textwrap.dedent(f"""
        import gc, shmcache
        creator = shmcache.create_pool({pool_name!r}, block_size=4, max_blocks=16)
        try:
            other = shmcache.attach({pool_name!r})
            other.allocate_block()
            del other                  # in a reference cycle: the GC collects it
            with creator._p.lock:      # as inside any op of creator
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
        raise AssertionError("the finalizer deadlocked on this thread's own pool lock")
    assert proc.returncode == 0, err
    assert "done" in out


def test_prepare_append_copies_a_shared_block_that_is_not_the_last(manager):
    # A partly filled shared block followed by a pre-added empty block: the new
    # token lands in the shared one, which must be copied, not written in place.
    t = manager.create_block_table("a")
    (a,) = manager.prepare_append(t, 2)
    f = manager.fork_block_table(t, "b")
    manager.add_block_to_table(f, manager.allocate_block(), 0)
    out = manager.prepare_append(f, 1)
    assert out[0].block_id != a.block_id
    assert manager.get_block_table("a").block_ids == [a.block_id]
    assert a.ref_count == 1 and out[0].ref_count == 1 and out[0].token_count == 3
    assert manager.check() == []

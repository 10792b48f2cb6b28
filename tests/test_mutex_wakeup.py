"""The pool mutex's wake-ups (shmcache.shm.lock, shmcache.system.platform_linux,
shmcache/_native/hot_mutex.h): no live waiter sleeps on a free lock,
whoever is killed and when; a lock word naming a thread that is gone is
taken over; and a fused C operation that finds the lock busy waits its
turn in C instead of falling to the slow path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from shmcache.shm import layout as L
from shmcache.shm import lock as shlock, segment

from _mutex import map_mutex, native_of, start_holder, tell
from _proc_client import wait_for_lock_waiter


# ----------------------------------------------------------------- lost wake-ups
#
# glibc's unlock wakes one waiter, and only when the lock word carries
# FUTEX_WAITERS. Two ways a live waiter used to sleep forever on a free lock
# follow; each test builds the sequence deterministically and asserts that the
# waiter gets the lock within a bounded time, through a timed-lock slice that
# ran out (``lock_slices``), i.e. nobody woke it.

@pytest.mark.parametrize("pure", [False, True], ids=["c", "ctypes"])
@pytest.mark.timeout(60)
def test_a_waiter_gets_a_lock_whose_unlocker_died_before_the_wake(make_pool, pure):
    """The unlocker clears the lock word and is killed before its futex wake."""
    if not shlock.ACCELERATED and not pure:
        pytest.skip("shmcache._hot is not built here")
    mgr = make_pool(max_blocks=16)
    native = native_of(mgr, pure)
    path = segment.path_for(mgr.name)
    holder = start_holder(mgr.name, pure)
    try:
        got = {}
        th = threading.Thread(target=lambda: got.setdefault("b", mgr.allocate_block()), daemon=True)
        th.start()
        wait_for_lock_waiter(path, os.getpid())       # asleep in futex(), word has FUTEX_WAITERS
        slices = native.lock_slices()
        tell(holder, "clear")
        tell(holder, "exit")                          # dies without the wake
        assert holder.wait(timeout=20) == 0
        th.join(timeout=5)
        assert not th.is_alive(), "the waiter sleeps on a free lock: lost wake-up"
        assert got["b"] is not None
        assert native.lock_slices() > slices          # a slice ran out: nobody woke it
    finally:
        holder.kill()
    assert mgr.check() == []


_SPIN = textwrap.dedent("""
    import os, sys, time
    os.sched_setaffinity(0, {int(sys.argv[1])})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    print("spinning", flush=True)
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        pass
""")

_WAITER = textwrap.dedent("""
    import os, sys
    import shmcache
    os.sched_setaffinity(0, {int(sys.argv[2])})
    mgr = shmcache.attach(sys.argv[1])
    print("attached", flush=True)
    sys.stdin.readline()
    mgr.allocate_block()           # blocks on the lock; killed before it runs again
""")


def _can_run_fifo() -> bool:
    try:
        r = subprocess.run([sys.executable, "-c", "import os; os.sched_setscheduler(0, os.SCHED_FIFO,"
                            " os.sched_param(1))"], timeout=20, capture_output=True)
        return r.returncode == 0
    except Exception:
        return False


@pytest.mark.parametrize("pure", [False, True], ids=["c", "ctypes"])
@pytest.mark.timeout(90)
def test_a_waiter_gets_the_lock_when_the_woken_waiter_is_killed_before_it_runs(make_pool, pure):
    """The sequence of the review: the holder unlocks and the kernel wakes W1;
    before W1 runs (a SCHED_FIFO busy loop holds its CPU) a third locker takes
    the free lock by CAS, so the word has no FUTEX_WAITERS bit; W1 is SIGKILLed
    (the kernel's exit handling wakes nobody: the word names a live owner);
    the third unlocks without a wake. W2 must still get the lock."""
    if not shlock.ACCELERATED and not pure:
        pytest.skip("shmcache._hot is not built here")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one to hold the woken waiter off")
    if not _can_run_fifo():
        pytest.skip("SCHED_FIFO is not permitted here (needs CAP_SYS_NICE)")
    cpu_a, cpu_b = cpus[0], cpus[1]
    old_aff = os.sched_getaffinity(0)
    mgr = make_pool(max_blocks=16)
    native = native_of(mgr, pure)
    path = segment.path_for(mgr.name)
    env = dict(os.environ)
    env.pop("SHMCACHE_PURE", None)
    if pure:
        env["SHMCACHE_PURE"] = "1"
    procs = []
    mm = map_mutex(mgr.name)
    third = shlock.open_mutex(mm) if not pure else shlock.reference_mutex(mm)
    try:
        os.sched_setaffinity(0, {cpu_a})
        w1 = subprocess.Popen([sys.executable, "-c", _WAITER, mgr.name, str(cpu_b)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(w1)
        assert w1.stdout.readline().strip() == "attached"   # (attaching takes the lock)
        holder = start_holder(mgr.name, pure)
        procs.append(holder)
        w1.stdin.write("go\n")
        w1.stdin.flush()
        wait_for_lock_waiter(path, w1.pid)              # W1 first in the futex queue
        got = {}

        def w2():
            os.sched_setaffinity(0, {cpu_a})
            got["b"] = mgr.allocate_block()
        th = threading.Thread(target=w2, daemon=True)
        th.start()
        wait_for_lock_waiter(path, os.getpid())         # W2 second
        slices = native.lock_slices()
        spin = subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu_b), "0.6"],
                                stdout=subprocess.PIPE, text=True)
        procs.append(spin)
        assert spin.stdout.readline().strip() == "spinning"
        tell(holder, "unlock")                         # wakes W1, which cannot run
        assert third.trylock() == 0                     # the third locker's CAS
        w1.kill()                                       # killed before it ran
        assert spin.wait(timeout=30) == 0
        w1.wait(timeout=30)
        third.unlock()                                  # no FUTEX_WAITERS: no wake
        th.join(timeout=5)
        assert not th.is_alive(), "W2 sleeps on a free lock: lost wake-up"
        assert got["b"] is not None
        assert native.lock_slices() > slices            # a slice ran out: nobody woke it
    finally:
        os.sched_setaffinity(0, old_aff)
        for p in procs:
            p.kill()
        third.release()
        mm.close()
    assert mgr.check() == []


@pytest.mark.parametrize("pure", [False, True], ids=["c", "ctypes"])
@pytest.mark.timeout(60)
def test_a_lock_word_naming_a_dead_thread_is_taken_over(make_pool, pure):
    """A lock word that names a thread that no longer exists, which the
    kernel never marked (a planted or corrupted word, a holder without a
    robust-list entry), used to make every locker wait forever: now the
    owner is found gone after about a second and the lock is taken as from
    a dead holder (the pool marked dirty, so it is repaired)."""
    if not shlock.ACCELERATED and not pure:
        pytest.skip("shmcache._hot is not built here")
    mgr = make_pool(max_blocks=16)
    native = native_of(mgr, pure)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=20)                      # its pid (= its thread id) is gone
    import ctypes
    ctypes.c_uint32.from_buffer(mgr.pool.mm, L.MUTEX_OFF).value = dead.pid
    assert native.trylock() == -1              # looks held
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("b", mgr.allocate_block()), daemon=True)
    th.start()
    th.join(timeout=10)
    assert not th.is_alive(), "waits forever on a lock whose owner no longer exists"
    assert got["b"] is not None
    assert mgr.check() == []


# ------------------------------------------------ a fused op on a busy lock
#
# The fused allocate/free spin briefly; when the lock stays busy they sleep
# in the kernel until it is theirs, hand it back and try again in C, rather
# than running the operation in Python under the lock (the slow path), which
# on many processes turned one fallback into a convoy.

def _alloc_in_thread(mgr):
    native, got = mgr.pool.native, {}
    th = threading.Thread(target=lambda: got.setdefault(
        "ids", native.alloc(1, mgr.pool.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf)), daemon=True)
    th.start()
    wait_for_lock_waiter(segment.path_for(mgr.name), os.getpid())   # asleep in futex()
    return th, got


@pytest.mark.skipif(not shlock.ACCELERATED, reason="shmcache._hot is not built here")
@pytest.mark.timeout(60)
def test_a_fused_alloc_that_finds_the_lock_busy_waits_its_turn_in_c(make_pool):
    mgr = make_pool(max_blocks=16)
    native = mgr.pool.native
    holder = start_holder(mgr.name, False)
    try:
        native.log_waits(True)
        th, got = _alloc_in_thread(mgr)
        ops = int(mgr.pool.c[L.C_OPS])
        tell(holder, "unlock")
        th.join(timeout=10)
        assert not th.is_alive()
        # done in C after its wait (the slow path would have returned None)
        assert isinstance(got["ids"], list) and len(got["ids"]) == 1
        assert int(mgr.pool.c[L.C_OPS]) == ops + 1
        waits = native.take_waits()
        assert len(waits) == 1 and waits[0] > 0 and native.take_waits() == []
        assert mgr.internals.holder.refs.loose.blocks() == got["ids"]
        assert native.free(got["ids"], mgr.pool.slot, mgr.internals.holder.epoch, mgr.internals.holder.refs.loose.buf) == 1
    finally:
        native.log_waits(False)
        tell(holder, "exit")
        holder.wait(timeout=20)
    assert mgr.check() == [] and mgr.free_blocks == 15


@pytest.mark.skipif(not shlock.ACCELERATED, reason="shmcache._hot is not built here")
@pytest.mark.timeout(60)
def test_a_fused_alloc_whose_holder_dies_while_it_waits_leaves_the_repair_to_the_slow_path(
        make_pool):
    mgr = make_pool(max_blocks=16)
    holder = start_holder(mgr.name, False)
    try:
        th, got = _alloc_in_thread(mgr)
        holder.kill()                          # dies holding the lock
        holder.wait(timeout=20)
        th.join(timeout=10)
        assert not th.is_alive()
        # it got the lock from the dead holder: the pool is marked for repair,
        # so the retry changed nothing and left the op to the slow path
        assert got["ids"] is None and mgr.pool.c[L.C_DIRTY] == 1
    finally:
        holder.kill()
    recoveries = int(mgr.pool.c[L.C_RECOVERIES])
    b = mgr.allocate_block()                   # the slow path repairs, then allocates
    assert b is not None and int(mgr.pool.c[L.C_RECOVERIES]) == recoveries + 1
    assert mgr.pool.c[L.C_DIRTY] == 0 and mgr.check() == []

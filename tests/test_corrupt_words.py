"""A corrupted word of a live pool hangs nobody (issue 29, "The pool").

Each test corrupts one word of a pool that real processes use, the way a
stray write or a same-user attacker would, and asserts that every process
either makes progress or gets a clear pool error within a bound, that
``shmcache fsck`` reports what is wrong, and that ``fsck --repair`` leaves
the pool consistent:

- a table's claim naming a live, attached process that is not appending
  (shmcache/shm/claims.py: a bounded wait, then taken over);
- the pool lock's word naming a live process that never attached, or a
  zombie (slots.lock_owner_problem: taken over as from a dead holder);
- a table whose owner field names no attached slot (reclaim releases it);
- a lock word overwritten while held (a CorruptPoolError, not a raw
  PermissionError);
- /dev/shm out of inodes (InsufficientSharedMemoryError, not a raw OSError);
- ``shmcache cleanup`` of a pool whose owner is an unreaped zombie.

The C path and the pure one (``SHMCACHE_PURE=1``) run where they differ.
Every wait has a timeout.
"""

from __future__ import annotations

import ctypes
import os
import select
import subprocess
import sys
import time

import pytest

from shmcache.shm import claims, segment, slots
from shmcache.shm import layout as L

from _cli import run
from conftest import new_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = pytest.mark.parametrize("pure", [False, True], ids=["c", "pure"])

# An attached process that does nothing until told (its slot is alive).
IDLE = r"""
import sys, shmcache
m = shmcache.attach(sys.argv[1])
print(m.pool.slot, flush=True)
sys.stdin.readline()
m.close()
"""

# Attach, run a few operations (on table "t" when it exists), print the
# seconds they took.
OPS = r"""
import sys, time, shmcache
t0 = time.monotonic()
m = shmcache.attach(sys.argv[1])
t = m.get_block_table("t")
if t is not None:
    m.prepare_append(t, 1)
b = m.allocate_block()
m.free_block(b)
print(round(time.monotonic() - t0, 3), flush=True)
m.close()
"""


def _env(pure: bool) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.pop("SHMCACHE_PURE", None)
    if pure:
        e["SHMCACHE_PURE"] = "1"
    return e


def _start(code, *args, pure=False):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_env(pure))


def _line(p, timeout=30.0) -> str:
    r, _, _ = select.select([p.stdout], [], [], timeout)
    assert r, "the child did not answer in time"
    return p.stdout.readline().strip()


def _ops(name, pure, timeout=30) -> float:
    """Seconds another process took to attach and run a few operations."""
    r = subprocess.run([sys.executable, "-c", OPS, name], capture_output=True, text=True,
                       env=_env(pure), timeout=timeout)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip())


def _set_lock_word(mgr, value: int) -> None:
    ctypes.c_uint32.from_buffer(mgr.pool.mm, L.MUTEX_OFF).value = value


def _sleeper():
    """A live process that never attached."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


# ------------------------------------------------------------ (6) claims
@MODES
@pytest.mark.timeout(90)
def test_a_claim_naming_a_live_attached_process_hangs_nobody(make_pool, pure):
    a = make_pool(block_size=4, max_blocks=32)
    t = a.create_block_table("t")
    a.prepare_append(t, 5)
    idle = _start(IDLE, a.name)
    try:
        slot = int(_line(idle))
        a.pool.t_claim[t.internals.table] = slot + 1              # a corrupted word: slot is alive, idle
        took = _ops(a.name, pure)                  # used to hang forever
        assert took < claims.CLAIM_STUCK_S + 8
        assert a.pool.t_claim[t.internals.table] == 0 and t.num_tokens == 6
        if not pure:    # (the command below is the same in both modes)
            a.pool.t_claim[t.internals.table] = slot + 1
            r = run("fsck", a.name)
            assert r.returncode == 1 and "stuck or corrupted claim" in r.stdout, r.stdout
            # again, and fsck --repair clears it
            a.pool.t_claim[t.internals.table] = slot + 1
            r = run("fsck", "--repair", a.name, timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr
            assert a.pool.t_claim[t.internals.table] == 0
            assert run("fsck", a.name).returncode == 0
    finally:
        idle.kill()
        idle.wait(timeout=10)
    assert a.check() == []


# ------------------------------------------------------------ (7) the lock word
@MODES
@pytest.mark.timeout(90)
def test_a_lock_word_naming_a_live_process_that_never_attached_hangs_nobody(make_pool, pure):
    a = make_pool(block_size=4, max_blocks=32)
    s = _sleeper()
    try:
        _set_lock_word(a, s.pid)
        assert a.pool.native.trylock() == -1         # looks held
        took = _ops(a.name, pure)                  # attach and ops used to hang forever
        assert slots.UNRECORDED_OWNER_S - 0.5 < took < slots.UNRECORDED_OWNER_S + 8
        if not pure:    # (the commands below are the same in both modes)
            _set_lock_word(a, s.pid)
            r = run("fsck", a.name)
            assert r.returncode == 1 and "is no hold" in r.stdout, r.stdout
            r = run("inspect", a.name)
            assert r.returncode == 0 and "NO HOLD" in r.stdout, r.stdout
            r = run("fsck", "--repair", a.name, timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr
            assert run("fsck", a.name).returncode == 0
    finally:
        s.kill()
        s.wait(timeout=10)
    assert a.check() == [] and a.get_stats().free_blocks == 31


@MODES
@pytest.mark.timeout(60)
def test_a_lock_word_naming_a_zombie_is_taken_over_in_about_a_second(make_pool, pure):
    a = make_pool(block_size=4, max_blocks=32)
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 20
        while slots.thread_status(z.pid)[1] != "Z":         # exited, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _set_lock_word(a, z.pid)
        took = _ops(a.name, pure)
        assert took < 6
        assert slots.thread_status(z.pid)[1] == "Z"         # (still a zombie)
    finally:
        z.wait(timeout=10)
    assert a.check() == []


@MODES
@pytest.mark.timeout(60)
def test_a_lock_word_overwritten_while_held_raises_a_pool_error(make_pool, pure):
    """The holder's unlock finds the word not its own (EPERM): a clear
    CorruptPoolError, not a raw PermissionError; the pool is marked for
    repair, and the next holder takes the word over and repairs."""
    code = r"""
import ctypes, subprocess, sys, shmcache
from shmcache.shm import layout as L
from shmcache.errors import CorruptPoolError
m = shmcache.attach(sys.argv[1])
dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()
try:
    with m.pool.lock:
        ctypes.c_uint32.from_buffer(m.pool.mm, L.MUTEX_OFF).value = dead.pid
except CorruptPoolError as e:
    print("CorruptPoolError", int(m.pool.c[L.C_DIRTY]), e, flush=True)
b = m.allocate_block()          # the word names a thread that is gone: taken over
m.free_block(b)
print("ok", flush=True)
m.close()
"""
    a = make_pool(block_size=4, max_blocks=32)
    recoveries = int(a.pool.c[L.C_RECOVERIES])
    r = subprocess.run([sys.executable, "-c", code, a.name], capture_output=True, text=True,
                       env=_env(pure), timeout=30)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("CorruptPoolError 1 ") and "lock word was overwritten" in out[0]
    assert out[1] == "ok" and "PermissionError" not in r.stderr
    assert int(a.pool.c[L.C_RECOVERIES]) > recoveries
    assert a.check() == []


# ------------------------------------------------------------ (8) table owners
@pytest.mark.timeout(60)
def test_a_table_whose_owner_is_no_attached_slot_is_reported_and_released(make_pool):
    a = make_pool(block_size=4, max_blocks=32)
    t = a.create_block_table("leak")
    for b in a.get_new_blocks(3):
        a.add_block_to_table(t, b, 4)
    a.pool.t_owner[t.internals.table] = a.pool.layout.max_slots - 1      # a corrupted owner: not attached
    r = run("fsck", a.name)
    assert r.returncode == 1 and "which is not attached" in r.stdout, r.stdout
    assert a.get_stats().free_blocks == 28
    r = run("fsck", "--repair", a.name, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert a.get_block_table("leak") is None
    assert a.get_stats().free_blocks == 31 and a.check() == []


# ------------------------------------------------------------ (10) inodes
@pytest.mark.timeout(60)
def test_dev_shm_out_of_inodes_raises_insufficient_shared_memory(tmp_path):
    """In a mount namespace of its own, /dev/shm is a tmpfs with 3 inodes,
    all used: creating a pool is InsufficientSharedMemoryError."""
    code = r"""
import os, shmcache
for i in range(8):
    try:
        open(f"/dev/shm/fill{i}", "w").close()
    except OSError:
        break
try:
    shmcache.create_pool("inodes", block_size=4, max_blocks=16)
except shmcache.InsufficientSharedMemoryError as e:
    print("InsufficientSharedMemoryError", e)
"""
    setup = "mount -t tmpfs -o nr_inodes=3,size=8m none /dev/shm && exec \"$0\" -c \"$1\""
    for pre in (["unshare", "-m"], ["unshare", "-Urm"]):
        try:
            r = subprocess.run(pre + ["sh", "-c", setup, sys.executable, code],
                               capture_output=True, text=True, env=_env(False), timeout=30)
        except FileNotFoundError:
            pytest.skip("unshare(1) is not installed")
        if "mount" not in r.stderr and "unshare" not in r.stderr:
            break
    else:
        pytest.skip(f"cannot mount a private tmpfs here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("InsufficientSharedMemoryError"), r.stdout + r.stderr
    assert "inodes" in r.stdout


# ------------------------------------------------------------ (11) zombies
@pytest.mark.timeout(60)
def test_cleanup_removes_a_pool_whose_owner_is_an_unreaped_zombie():
    name = new_name("zombie")
    code = ("import os, sys, shmcache\nm = shmcache.create_pool(sys.argv[1], block_size=4, "
            "max_blocks=16)\nprint('ready', flush=True)\nos._exit(0)\n")
    p = _start(code, name)
    try:
        assert _line(p) == "ready"
        deadline = time.monotonic() + 20
        while slots.thread_status(p.pid)[1] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = run("cleanup", name)
        assert r.returncode == 0 and "removed" in r.stdout, r.stdout
        assert name not in segment.list_names()
    finally:
        p.wait(timeout=10)
        segment.unlink(name)

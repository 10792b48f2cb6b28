"""``shmcache fsck``: the invariant check, read-only and lock-free without
``--repair``; the repair, and dead holders' references released.

Every command runs as a real subprocess (``tests/_cli.py``).
"""

from __future__ import annotations

import subprocess
import sys
import time

from shmcache.shm import layout as L
from shmcache.shm import segment

from _cli import busy_pool, run
from _cli import holders  # pytest fixture

# the fixture imported above, listed so that pyflakes counts it as used
__all__ = ["holders"]


# -------------------------------------------------------------------- fsck
def test_fsck_consistent(make_pool):
    m = busy_pool(make_pool)
    r = run("fsck", m.name)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "consistent" in lines[0], lines


def test_fsck_finds_and_repairs_corruption(make_pool):
    m = busy_pool(make_pool)
    free_block = next(b for b in range(1, 32) if m.pool.b_ref[b] == 0)
    m.pool.b_ref[free_block] = 5                  # a free block claims 5 references
    r = run("fsck", m.name)
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    assert lines and all(line.startswith(f"{m.name}: ") for line in lines)
    assert any(f"block {free_block}: ref_count 5" in line for line in lines)
    assert len(lines) == len(m.check())          # one line per violation
    r = run("fsck", m.name, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "repair" in r.stdout and "consistent after repair" in r.stdout
    assert m.check() == []
    assert run("fsck", m.name).returncode == 0


def test_fsck_is_read_only_even_on_a_dirty_pool(make_pool):
    """fsck without --repair takes no slot, no lock and no part in recovery:
    not one byte of a dirty, corrupted pool changes (it used to attach, and
    the first lock repaired the pool); --repair then rebuilds it."""
    m = busy_pool(make_pool)
    free_block = next(b for b in range(1, 32) if m.pool.b_ref[b] == 0)
    m.pool.b_ref[free_block] = 5
    m.pool.c[L.C_DIRTY] = 1
    path = segment.path_for(m.name)
    with open(path, "rb") as f:
        before = f.read()
    r = run("fsck", m.name)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "marked dirty" in r.stdout
    assert f"block {free_block}: ref_count 5" in r.stdout
    with open(path, "rb") as f:
        assert f.read() == before               # header, lock word, counters, slots, records
    assert m.pool.c[L.C_RECOVERIES] == 0
    r = run("fsck", m.name, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "was marked dirty" in r.stdout and "consistent after repair" in r.stdout
    assert m.pool.c[L.C_DIRTY] == 0 and m.pool.c[L.C_RECOVERIES] == 1
    assert m.check() == []


def test_fsck_never_waits_for_the_lock(make_pool):
    """A lock word naming a thread that is gone (no kernel hand-over) made
    fsck wait forever: the read-only check takes no lock at all, and reports
    the word as no hold (issue 29), the pool otherwise consistent."""
    m = busy_pool(make_pool)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    word = memoryview(m.pool.mm)[L.MUTEX_OFF:L.MUTEX_OFF + 4].cast("i")
    word[0] = int(gone)
    try:
        t0 = time.monotonic()
        r = run("fsck", m.name, timeout=30)
        assert time.monotonic() - t0 < 20
        assert r.returncode == 1, r.stdout + r.stderr
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 1 and "lock's word is no hold" in lines[0], r.stdout
        assert "does not exist" in lines[0]
    finally:
        word[0] = 0
        word.release()


def test_fsck_repair_releases_dead_holders(make_pool, holders):
    m = make_pool()
    h = holders(m.name, mode="attach", n=5)
    free0 = m.free_blocks
    h.kill()
    r = run("fsck", m.name)
    assert r.returncode == 0 and "1 dead, holding 5 references" in r.stdout, r.stdout
    r = run("fsck", m.name, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "released 5 references of 1 dead holder" in r.stdout
    assert m.free_blocks == free0 + 5
    assert m.check() == []

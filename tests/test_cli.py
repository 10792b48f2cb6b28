"""The ``shmcache`` command: list, inspect, top, fsck, cleanup, and their errors.

Every command runs as a real subprocess (the installed console script), so
exit codes, stdout/stderr and "no traceback" are what an operator sees.
Pools owned by other processes are made by small helper scripts that print
``ready`` and then wait to be killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from shmcache import layout as L
from shmcache import segment

from conftest import RUN, new_name

BIN = os.path.join(os.path.dirname(sys.executable), "shmcache")
CMD = [BIN] if os.path.exists(BIN) else [sys.executable, "-m", "shmcache.cli"]


def run(*args, timeout=60):
    return subprocess.run(CMD + list(args), capture_output=True, text=True, timeout=timeout)


def assert_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for w in words:
        assert w in lines[0], lines[0]


HOLDER = textwrap.dedent("""
    import sys, time, shmcache
    name, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "create":
        m = shmcache.create_pool(name, block_size=4, max_blocks=32)
    else:
        m = shmcache.attach(name)
    if n:
        m.get_new_blocks(n)
    print("ready", flush=True)
    time.sleep(120)
""")


class Holder:
    """A process that creates (or attaches to) a pool and holds ``n`` blocks."""

    def __init__(self, name, mode="create", n=0):
        self.p = subprocess.Popen([sys.executable, "-c", HOLDER, name, mode, str(n)],
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def kill(self):
        self.p.kill()
        self.p.wait()
        self.p.stdout.close()


@pytest.fixture
def holders():
    made = []

    def factory(*a, **kw):
        h = Holder(*a, **kw)
        made.append(h)
        return h
    yield factory
    for h in made:
        if h.p.poll() is None:
            h.kill()


def busy_pool(make_pool):
    """A pool with tables, a fork, a copy-on-write, cached blocks and a hit."""
    m = make_pool(block_size=4, max_blocks=32, num_layers=1, num_kv_heads=1, head_dim=8)
    t = m.create_block_table("r1")
    blocks = m.prepare_append(t, 10)
    m.cache_full_blocks(blocks, list(range(10)), 0, 2)
    f = m.fork_block_table(t, "r2")
    m.prepare_append(f, 1)                       # copies the shared last block
    got, n = m.acquire_computed_blocks(list(range(10)))
    assert n == 8
    m.get_new_blocks(2)
    return m


# ------------------------------------------------------------------ basics
def test_console_script_help():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("list", "inspect", "top", "fsck", "cleanup"):
        assert cmd in r.stdout


def test_list_shows_owner_size_usage(make_pool):
    m = busy_pool(make_pool)
    r = run("list")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.split()[0] == m.name)
    cols = row.split()
    assert cols[1] == str(os.getpid()) and cols[2] == "yes"
    assert cols[3] == "1" and cols[4] == "32"           # attached, blocks
    used = 32 - m.free_blocks
    assert f"{used}/32" in row and "%" in row


def test_inspect_json_matches_manager(make_pool):
    m = busy_pool(make_pool)
    r = run("inspect", m.name, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    s = m.get_stats()
    for k in ("allocated_blocks", "free_blocks", "shared_blocks", "total_tokens_cached",
              "cache_hits", "cache_misses", "cow_copies", "evictions"):
        assert d[k] == getattr(s, k), k
    assert d["cached_blocks"] == 2
    assert d["cow_copies"] == 1 and d["shared_blocks"] >= 2
    assert d["prefix_hit_rate"] == pytest.approx(s.cache_hits / (s.cache_hits + s.cache_misses))
    assert d["layout"]["block_size"] == 4 and d["layout"]["max_blocks"] == 32
    assert d["owner_pid"] == os.getpid() and d["owner_alive"] is True
    (h,) = d["holders"]
    assert h["pid"] == os.getpid() and h["alive"] is True
    assert h["tables"] == 2 and h["loose_blocks"] == 4 and h["table_blocks"] == 3 + 3
    assert m.check() == []


def test_inspect_text(make_pool):
    m = busy_pool(make_pool)
    r = run("inspect", m.name)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert m.name in out and f"pid {os.getpid()} (alive)" in out
    for w in ("allocated", "free", "shared", "cached", "hits", "misses", "prefix hit rate",
              "cow copies 1", "evictions", "block_size 4", "max_blocks 32", "holders"):
        assert w in out, w


def test_inspect_dead_owner_takes_no_slot(holders):
    name = new_name("dead")
    h = holders(name, n=3)
    h.kill()
    r = run("inspect", name, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["owner_alive"] is False
    (holder,) = d["holders"]                  # the dead one; inspect took no slot
    assert holder["alive"] is False and holder["loose_blocks"] == 3
    assert d["allocated_blocks"] == 4
    r = run("inspect", name)
    assert "(dead)" in r.stdout and "DEAD" in r.stdout


# ------------------------------------------------------------------ errors
@pytest.fixture
def junk_name():
    name = new_name("junk")
    yield name
    segment.unlink(name)


def write_segment(name, data: bytes):
    with open(segment.path_for(name), "wb") as f:
        f.write(data)


ERROR_CMDS = [("inspect",), ("inspect", "--json"), ("fsck",), ("fsck", "--repair"),
              ("top",), ("cleanup",)]


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_unknown_pool(cmd):
    r = run(cmd[0], new_name("missing"), *cmd[1:])
    assert_error(r, "no shmcache pool named")


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_not_a_pool(cmd, junk_name):
    write_segment(junk_name, b"hello, not a pool" * 400)
    r = run(cmd[0], junk_name, *cmd[1:])
    assert_error(r, "not a shmcache pool")
    assert os.path.exists(segment.path_for(junk_name))      # never removed


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_incompatible_version(cmd, junk_name):
    hdr = np.zeros(1, L.HEADER_DTYPE)
    hdr["magic"], hdr["version"], hdr["ready"] = L.MAGIC, L.LAYOUT_VERSION + 7, 1
    write_segment(junk_name, hdr.tobytes().ljust(8192, b"\0"))
    r = run(cmd[0], junk_name, *cmd[1:])
    assert_error(r, "layout version")


def test_tiny_segment_and_bad_name(junk_name):
    write_segment(junk_name, b"")
    assert_error(run("inspect", junk_name), "not a shmcache pool")
    assert_error(run("fsck", junk_name), "not a shmcache pool")   # at once, no 5 s wait
    assert_error(run("inspect", "../etc/passwd"), "invalid pool name")


def test_list_reports_unusable_segments(junk_name):
    write_segment(junk_name, b"x" * 100)
    r = run("list")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(junk_name))
    assert "not a shmcache pool" in row


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_segment_others_can_write_is_refused(cmd, make_pool):
    m = make_pool()
    path = segment.path_for(m.name)
    os.chmod(path, 0o666)
    with open(path, "rb") as f:
        before = f.read()
    r = run(cmd[0], m.name, *cmd[1:])
    assert_error(r, "writable by group and others", "0666")
    assert os.path.exists(path)                     # cleanup never removes it either
    with open(path, "rb") as f:
        assert f.read() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid needs root")
def test_segment_of_another_user_is_refused(make_pool):
    m = make_pool()
    os.chown(segment.path_for(m.name), 54321, -1)
    assert_error(run("inspect", m.name), "belongs to uid 54321")
    assert_error(run("fsck", m.name, "--repair"), "belongs to uid 54321")
    r = run("list")
    row = next(line for line in r.stdout.splitlines() if line.startswith(m.name))
    assert "not usable" in row and "54321" in row


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_corrupt_header_is_one_line(cmd, make_pool, junk_name):
    """An unknown dtype code was a KeyError traceback in attach, fsck and
    inspect: every header field is checked, and the error is one line."""
    m = make_pool()
    with open(segment.path_for(m.name), "rb") as f:
        data = bytearray(f.read())
    np.frombuffer(data, L.HEADER_DTYPE, 1)["dtype_code"] = 9
    write_segment(junk_name, bytes(data))
    r = run(cmd[0], junk_name, *cmd[1:])
    assert_error(r, "corrupt header", "unknown dtype code 9")
    assert os.path.exists(segment.path_for(junk_name))


# --------------------------------------------------------------------- top
def test_top_refreshes_until_ctrl_c(make_pool):
    m = busy_pool(make_pool)
    p = subprocess.Popen(CMD + ["top", m.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    time.sleep(2.5)
    m.get_new_blocks(3)                 # the next refresh shows it
    time.sleep(1.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=10)
    assert p.returncode == 0, err       # Ctrl-C is the normal way out: exit 0
    assert "Traceback" not in err
    frames = out.split("\x1b[H\x1b[2J")[1:]
    assert len(frames) >= 3, out
    assert all(m.name in f and "usage" in f for f in frames)
    assert "[#" in frames[-1] and "%" in frames[-1]
    allocated = [int(f.split("allocated ")[1].split(",")[0]) for f in frames]
    assert allocated[0] + 3 == allocated[-1]


def test_top_exits_when_pool_goes_away(make_pool):
    m = make_pool()
    p = subprocess.Popen(CMD + ["top", m.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    time.sleep(1.5)
    m.destroy()
    out, err = p.communicate(timeout=10)
    assert p.returncode == 2 and "went away" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -------------------------------------------------------------------- fsck
def test_fsck_consistent(make_pool):
    m = busy_pool(make_pool)
    r = run("fsck", m.name)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "consistent" in lines[0], lines


def test_fsck_finds_and_repairs_corruption(make_pool):
    m = busy_pool(make_pool)
    free_block = next(b for b in range(1, 32) if m._p.b_ref[b] == 0)
    m._p.b_ref[free_block] = 5                  # a free block claims 5 references
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
    free_block = next(b for b in range(1, 32) if m._p.b_ref[b] == 0)
    m._p.b_ref[free_block] = 5
    m._p.c[L.C_DIRTY] = 1
    path = segment.path_for(m.name)
    with open(path, "rb") as f:
        before = f.read()
    r = run("fsck", m.name)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "marked dirty" in r.stdout
    assert f"block {free_block}: ref_count 5" in r.stdout
    with open(path, "rb") as f:
        assert f.read() == before               # header, lock word, counters, slots, records
    assert m._p.c[L.C_RECOVERIES] == 0
    r = run("fsck", m.name, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "was marked dirty" in r.stdout and "consistent after repair" in r.stdout
    assert m._p.c[L.C_DIRTY] == 0 and m._p.c[L.C_RECOVERIES] == 1
    assert m.check() == []


def test_fsck_never_waits_for_the_lock(make_pool):
    """A lock word naming a thread that is gone (no kernel hand-over) made
    fsck wait forever: the read-only check takes no lock at all."""
    m = busy_pool(make_pool)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    word = memoryview(m._p.mm)[L.MUTEX_OFF:L.MUTEX_OFF + 4].cast("i")
    word[0] = int(gone)
    try:
        t0 = time.monotonic()
        r = run("fsck", m.name, timeout=30)
        assert time.monotonic() - t0 < 20
        assert r.returncode == 0 and "consistent" in r.stdout, r.stdout + r.stderr
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


# ----------------------------------------------------------------- cleanup
def test_cleanup_after_owner_sigkilled(holders):
    name = new_name("cl")
    h = holders(name, n=2)
    assert run("cleanup", name).returncode == 1          # owner alive: kept
    assert os.path.exists(segment.path_for(name))
    h.p.send_signal(signal.SIGKILL)
    h.p.wait()
    r = run("cleanup", name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"removed {segment.path_for(name)}" in r.stdout and "dead" in r.stdout
    assert not os.path.exists(segment.path_for(name))
    assert_error(run("cleanup", name), "no shmcache pool named")


def test_cleanup_never_removes_live_pool(make_pool):
    m = make_pool()
    r = run("cleanup", m.name)
    assert r.returncode == 1
    assert f"kept {m.name}: owner pid {os.getpid()} is alive" in r.stdout
    assert os.path.exists(segment.path_for(m.name))
    assert m.check() == [] and m.allocate_block() is not None


def test_cleanup_keeps_pool_with_live_attached_process(holders):
    name = new_name("cl")
    owner = holders(name)
    worker = holders(name, mode="attach", n=1)
    owner.kill()
    r = run("cleanup", name)
    assert r.returncode == 1 and "live process(es) attached" in r.stdout
    assert str(worker.p.pid) in r.stdout
    assert os.path.exists(segment.path_for(name))
    worker.kill()
    r = run("cleanup", name)
    assert r.returncode == 0 and "removed" in r.stdout
    assert not os.path.exists(segment.path_for(name))


def test_cleanup_pattern_removes_only_dead(make_pool, holders, junk_name):
    tag = f"{RUN}-glob{os.getpid()}"
    dead = [f"{tag}-{i}" for i in range(2)]
    for n in dead:
        holders(n, n=1).kill()
    live = make_pool(name=f"{tag}-live")
    write_segment(f"{tag}-junk", b"junk")
    try:
        r = run("cleanup", f"{tag}-*")
        assert r.returncode == 0, r.stdout + r.stderr
        for n in dead:
            assert f"removed {segment.path_for(n)}" in r.stdout
            assert not os.path.exists(segment.path_for(n))
        assert f"kept {live.name}" in r.stdout and os.path.exists(segment.path_for(live.name))
        assert f"skipped {tag}-junk: " in r.stdout and os.path.exists(segment.path_for(f"{tag}-junk"))
        r = run("cleanup", f"{tag}-*")
        assert "nothing removed" in r.stdout
    finally:
        segment.unlink(f"{tag}-junk")


def test_version_is_pyprojects():
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    want = re.search(r'(?m)^version = "([^"]+)"', (root / "pyproject.toml").read_text()).group(1)
    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"shmcache {want}\n" and r.stderr == ""


# ------------------------------------------------------------------ L2 counters
def test_inspect_shows_the_pool_wide_l2_counters_only_when_used(make_pool):
    """Counters 16..26 (every process's L2 tier adds to them): in --json
    always, in the text an "L2" section only once one is not zero."""
    m = busy_pool(make_pool)
    d = json.loads(run("inspect", m.name, "--json").stdout)
    assert d["l2"] == dict.fromkeys(L.L2_COUNTERS, 0)
    assert "\nL2 " not in run("inspect", m.name).stdout
    m.add_counters({L.C_L2["lookups"]: 2, L.C_L2["hits"]: 6, L.C_L2["misses"]: 2,
                    L.C_L2["read_bytes"]: 3 << 20, L.C_L2["writes"]: 9,
                    L.C_L2["rejected"]: 1, L.C_L2["outages"]: 1})
    m.add_counters({L.C_L2["hits"]: 1})                  # another process's, summed
    r = run("inspect", m.name, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["l2"] == m.l2_counters()
    assert (d["l2"]["hits"], d["l2"]["writes"], d["l2"]["outages"]) == (7, 9, 1)
    out = run("inspect", m.name).stdout
    line = next(x for x in out.splitlines() if x.startswith("L2 "))
    assert "lookups 2" in line and "blocks hit 7" in line and "missed 2" in line
    assert "hit rate 77.8%" in line and "read 3.0 MiB" in line and "rejected 1" in line
    assert "blocks written 9" in out and "outages 1" in out

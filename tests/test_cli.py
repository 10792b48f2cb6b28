"""The ``shmcache`` command (``shmcache.cli``): help, version, list, inspect
(with the L2 counters) and top.

Every command runs as a real subprocess (``tests/_cli.py``). The errors every
command reports are in ``test_cli_errors.py``; fsck and cleanup in
``test_cli_fsck.py`` and ``test_cli_cleanup.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from shmcache.shm import layout as L
from shmcache.shm import lock as shlock

from conftest import new_name
from _cli import CMD, busy_pool, run
from _cli import holders  # pytest fixture

# the fixture imported above, listed so that pyflakes counts it as used
# (and CMD: test_refs.py imports it from here)
__all__ = ["CMD", "holders"]


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
    assert row.endswith(", 2 cached")                   # busy_pool's two unreferenced prefixes


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
    # the fused ops' turns at the lock (C only): each handed on, none waiting
    assert d["lock_turns"] == int(m.pool.c[L.C_TURN_NEXT]) and d["lock_queue"] == 0
    assert (d["lock_turns"] > 0) == shlock.ACCELERATED
    assert m.check() == []


def test_inspect_text(make_pool):
    m = busy_pool(make_pool)
    r = run("inspect", m.name)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert m.name in out and f"pid {os.getpid()} (alive)" in out
    for w in ("allocated", "free", "shared", "cached", "hits", "misses", "prefix hit rate",
              "cow copies 1", "evictions", "block_size 4", "max_blocks 32", "holders",
              "(0 waiting)"):
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
    """The l2_* counters (every process's L2 tier adds to them): in --json
    always, in the text an "L2" section only once one is not zero."""
    m = busy_pool(make_pool)
    d = json.loads(run("inspect", m.name, "--json").stdout)
    assert d["l2"] == dict.fromkeys(L.L2_COUNTERS, 0)
    assert "\nL2 " not in run("inspect", m.name).stdout
    m.add_counters({"l2_lookups": 2, "l2_hits": 6, "l2_misses": 2,
                    "l2_read_bytes": 3 << 20, "l2_writes": 9,
                    "l2_rejected": 1, "l2_outages": 1})
    m.add_counters({"l2_hits": 1})                  # another process's, summed
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


def test_every_subcommand_help_says_what_it_does():
    """``shmcache NAME --help`` opens with a sentence on what NAME does."""
    from shmcache.cli import build_parser
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "cmd")
    for name, p in sub.choices.items():
        assert p.description and len(p.description) > 20, name

"""Several independent processes on one named pool.

Every worker is ``tests/_proc_server.py`` started with ``subprocess.Popen``
(not forked from the test process): it finds the pool only by its name.
Every wait has a timeout, and every worker is killed in teardown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import segment

from _proc_client import (RemoteError, family_tokens, lock_is_busy, verify_blocks,
                          wait_for_lock_waiter)

BS = 4
LAYOUT = dict(block_size=BS, num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32")


def released(mgr) -> None:
    """Everything is free: only the null block is held, no table, only ``mgr`` attached."""
    assert mgr.check() == []
    assert mgr.free_blocks == mgr.max_blocks - 1
    assert len(mgr.request_tables) == 0
    hold = mgr.holdings()
    assert [h["slot"] for h in hold] == [mgr.pool.slot], hold
    assert hold[0]["tables"] == hold[0]["loose_blocks"] == 0
    s = mgr.get_stats()
    assert s.allocated_blocks == 1 and s.shared_blocks == 0 and s.tokens_held == 0
    assert s.refs_held == 0 and s.block_tables == 0


@pytest.mark.timeout(120)
def test_four_independent_processes_random_work(make_pool, spawn):
    mgr = make_pool(max_blocks=160, max_tables=256, max_refs=4096, **LAYOUT)
    workers = [spawn("random", mgr.name, seed, 3.5) for seed in (11, 22, 33, 44)]
    slots = [w.ready() for w in workers]
    assert len(set(slots + [mgr.pool.slot])) == 5
    hold = {h["pid"]: h for h in mgr.holdings()}
    assert set(hold) == {os.getpid()} | {w.pid for w in workers}
    assert all(h["alive"] for h in hold.values())
    for w in workers:
        w.send("go")
    # The parent watches the pool while they run: every snapshot is consistent.
    deadline = time.monotonic() + 60
    snapshots = 0
    while any(w.alive() for w in workers):
        assert mgr.check() == []
        s = mgr.get_stats()
        assert s.allocated_blocks + s.free_blocks == s.total_blocks
        snapshots += 1
        try:
            next(w for w in workers if w.alive()).proc.wait(timeout=0.25)
        except (subprocess.TimeoutExpired, StopIteration):
            pass
        assert time.monotonic() < deadline, "workers did not finish"
    assert snapshots > 0
    summaries = []
    for w in workers:
        summaries.append(json.loads(w.expect("DONE", timeout=30)))
        assert w.wait(timeout=30) == 0, w.stderr_text()
    ops = set()
    for s in summaries:
        assert s["steps"] > 100, s
        assert s["max_latency"] < 5.0, s
        ops |= set(s["counts"])
    assert ops >= {"alloc", "get_new", "free", "free_batch", "request", "append", "fork",
                   "foreign_fork", "delete", "verify"}
    assert sum(s["verified_blocks"] for s in summaries) > 0
    assert sum(s["acquired_hits"] for s in summaries) > 0, "nobody hit the prefix cache"
    st = mgr.get_stats()
    assert st.cache_hits > 0 and st.cow_copies > 0
    released(mgr)
    # the pool outlives the processes that attached to it and exited
    assert os.path.exists(segment.path_for(mgr.name))


@pytest.mark.timeout(60)
def test_lock_excludes_across_processes(make_pool, spawn, tmp_path):
    mgr = make_pool(max_blocks=16, **LAYOUT)
    path = segment.path_for(mgr.name)
    order = tmp_path / "order"
    child = spawn("serve", mgr.name)
    child.ready()
    assert child.call("lock_enter") is True
    # Another mapping of the segment cannot take the lock.
    assert lock_is_busy(path)

    got = {}

    def parent_op():
        got["block"] = mgr.allocate_block().block_id
        got["stats"] = mgr.get_stats()
        with open(order, "a") as f:
            f.write("parent-done\n")

    th = threading.Thread(target=parent_op, daemon=True)
    th.start()
    # The kernel shows our thread blocked on the pool mutex: a handshake, not a timer.
    wait_for_lock_waiter(path, os.getpid())
    assert th.is_alive() and not order.exists()
    # While it waits, the child changes the pool under the lock it holds.
    child_blocks = child.call("alloc", n=3)
    child.call("append_file", path=str(order), line="child-release")
    child.call("lock_exit")
    th.join(timeout=20)
    assert not th.is_alive(), "the parent stayed blocked after the child released the lock"
    assert order.read_text().splitlines() == ["child-release", "parent-done"]
    assert got["block"] not in child_blocks
    assert got["stats"].allocated_blocks == 1 + 3 + 1   # null + child's 3 + ours

    # And the other way round: the parent holds the lock, the child waits.
    with mgr.pool.lock:
        child.request("stats")
        wait_for_lock_waiter(path, child.pid)
        mine = [b.block_id for b in mgr.get_new_blocks(2)]
    st = child.result()
    assert st["allocated_blocks"] == 1 + 3 + 1 + 2        # saw our change, made under the lock
    assert mgr.pool.c[L.C_LOCK_WAIT_NS] > 0
    mgr.free_block_batch([got["block"]] + mine)
    child.call("free", ids=child_blocks)
    child.stop()
    assert child.wait(timeout=30) == 0
    released(mgr)


@pytest.mark.timeout(60)
def test_changes_are_visible_across_processes(make_pool, spawn):
    mgr = make_pool(max_blocks=32, **LAYOUT)
    a = spawn("serve", mgr.name)
    b = spawn("serve", mgr.name)
    a.ready(), b.ready()
    tokens = family_tokens(3, 2 * BS + 2)              # two full blocks and a partial one
    salt = 1

    # A: allocate, write K/V, build a table, publish its full blocks.
    ids = a.call("alloc", n=3)
    for i, blk in enumerate(ids):
        a.call("write", block=blk, tokens=tokens[:(i + 1) * BS], salt=salt, start=i * BS)
    a.call("create", rid="req-a")
    for i, blk in enumerate(ids):
        a.call("add", rid="req-a", block=blk, tokens=len(tokens[i * BS:(i + 1) * BS]))
    a.call("cache", rid="req-a", tokens=tokens, salt=salt)

    # The parent sees it: stats, the table, the payload, the cache.
    s = mgr.get_stats()
    assert s.allocated_blocks == 4 and s.total_tokens_cached == len(tokens)
    assert mgr.free_blocks == 32 - 4
    t = mgr.get_block_table("req-a")
    assert t.block_ids == ids and t.num_tokens == len(tokens)
    assert "req-a" in mgr.request_tables
    verify_blocks(mgr, ids, tokens, salt, "req-a read by the parent")
    found, n = mgr.get_computed_blocks(tokens, ("tenant", salt))
    assert [x.block_id for x in found] == ids[:2] and n == 2 * BS
    assert mgr.get_computed_blocks(tokens, None) == ([], 0)   # other salt, no sharing

    # B forks A's table and appends to the fork: COW copies the partial last block.
    assert b.call("table", rid="req-a") == {"block_ids": ids, "num_tokens": len(tokens)}
    assert b.call("fork", src="req-a", dst="req-b") == ids
    assert [mgr.blocks[x].ref_count for x in ids] == [2, 2, 2]
    out = b.call("prepare_append", rid="req-b", n=1)
    assert len(out) == 1 and out[0] not in ids
    fork_ids = mgr.get_block_table("req-b").block_ids
    assert fork_ids == ids[:2] + out
    assert mgr.blocks[ids[2]].ref_count == 1 and mgr.get_stats().cow_copies == 1
    b.call("write", block=out[0], tokens=tokens + [5555], salt=salt, start=len(tokens))
    # the copy carries the partial block's payload; the original is untouched
    verify_blocks(mgr, fork_ids, tokens + [5555], salt, "req-b after COW")
    verify_blocks(mgr, ids, tokens, salt, "req-a after B's COW")

    # B acquires the cached prefix (one atomic step) and checks the bytes A wrote.
    got, n = b.call("acquire", tokens=tokens, salt=salt)
    assert got == ids[:2] and n == 2 * BS
    assert b.call("verify", ids=got, tokens=tokens[:2 * BS], salt=salt) is True
    assert mgr.blocks[ids[0]].ref_count == 3

    # B deletes A's table; A no longer finds it.
    b.call("delete", rid="req-a")
    assert a.call("table", rid="req-a") is None
    assert a.call("tables") == ["req-b"]
    with pytest.raises(RemoteError) as ei:
        a.call("delete", rid="req-a")
    assert ei.value.kind == "KeyError"
    assert mgr.blocks[ids[2]].ref_count == 0 and ids[2] in mgr.free_block_queue.ids()

    # A exits cleanly: it held nothing any more, and the pool stays.
    a.stop()
    assert a.wait(timeout=30) == 0
    assert os.path.exists(segment.path_for(mgr.name))
    assert mgr.check() == []
    # B's close releases its fork and its acquired blocks.
    assert {h["pid"] for h in mgr.holdings()} == {os.getpid(), b.pid}
    b.call("close")
    assert mgr.get_block_table("req-b") is None
    b.stop()
    assert b.wait(timeout=30) == 0
    released(mgr)
    # the published blocks stay cached (free, reusable) after everyone left
    found, n = mgr.get_computed_blocks(tokens, ("tenant", salt))
    assert [x.block_id for x in found] == ids[:2]


@pytest.mark.timeout(60)
def test_attach_from_an_unrelated_process_session(make_pool, spawn):
    """A worker in its own session (not sharing our process group) attaches by name."""
    mgr = make_pool(max_blocks=16, **LAYOUT)
    code = ("import sys, os; sys.path.insert(0, %r); import shmcache; "
            "m = shmcache.attach(%r); b = m.allocate_block(); "
            "print(os.getsid(0), m.get_stats().allocated_blocks, b.block_id); m.close()"
            % (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), mgr.name))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, start_new_session=True)
    assert r.returncode == 0, r.stderr
    sid, allocated, blk = map(int, r.stdout.split())
    assert sid != os.getsid(0)
    assert allocated == 2 and 0 < blk < 16
    released(mgr)
    with pytest.raises(shmcache.PoolNotFoundError):
        shmcache.attach(mgr.name + "-missing")

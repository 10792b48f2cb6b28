"""What a departed process held is released (``shmcache.pool.reclaim``): SIGKILL
at random moments while others work, every kind of reference, close() as
death does, pid reuse, and dead slots reused.

Workers are ``tests/_proc_server.py`` started with ``subprocess.Popen``
(independent processes attaching by name). Every wait has a timeout; every
worker is killed in teardown; pools are destroyed by ``make_pool``. Deaths
mid-update under the lock, and the repair, are in ``test_recovery.py``.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import psutil
import pytest

from shmcache.shm import layout as L
from shmcache.shm import segment

from _deaths import (BLOCKED_BOUND, BS, LAYOUT, dead_entries, lock_is_held_elsewhere, publish,
                     ref_counts)
from _proc_client import RemoteError, family_tokens, verify_blocks
from _proc_server import SCRIBBLES


def run_with_deadline(fn, timeout: float):
    """Run ``fn`` in a thread; fail (instead of hanging) if it takes longer than ``timeout``."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised below
            out["error"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(timeout)
    elapsed = time.monotonic() - t0
    assert not th.is_alive(), f"operation still blocked after {timeout}s"
    if "error" in out:
        raise out["error"]
    return out["value"], elapsed


def build_holdings(w, tokens) -> dict:
    """Make serve-worker ``w`` hold references of every kind; return what it holds."""
    acquired, n = w.call("acquire", tokens=tokens, salt=0)     # shared with the parent's chain
    assert n == len(acquired) * BS and acquired
    loose = w.call("alloc", n=2)
    w.call("create", rid=f"t1-{w.pid}")
    for b in acquired:
        w.call("add", rid=f"t1-{w.pid}", block=b, tokens=BS)
    extra = w.call("alloc", n=2)
    for b in extra:
        w.call("add", rid=f"t1-{w.pid}", block=b, tokens=BS)
    w.call("fork", src=f"t1-{w.pid}", dst=f"t2-{w.pid}")
    w.call("prepare_append", rid=f"t2-{w.pid}", n=3)
    again, _ = w.call("acquire", tokens=tokens, salt=0)        # loose refs to cached blocks
    table_blocks = (len(w.call("table", rid=f"t1-{w.pid}")["block_ids"])
                    + len(w.call("table", rid=f"t2-{w.pid}")["block_ids"]))
    return {"tables": 2, "table_blocks": table_blocks, "loose_blocks": len(loose) + len(again)}


def alloc_retrying(w, n: int, timeout: float = 20.0) -> list:
    """Allocate ``n`` blocks in worker ``w`` while others compete for a full pool."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return w.call("alloc", n=n)
        except RemoteError as e:
            if e.kind != "OutOfBlocksError" or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# ---------------------------------------------------------------- many kills
def start_scribbler(spawn, name):
    s = spawn("serve", name)
    s.ready()
    return s


@pytest.mark.timeout(180)
def test_sigkill_random_workers_many_times(make_pool, spawn):
    """21 SIGKILLs: 16 of random workers at random moments of their work, 5 of
    processes holding the lock with half an update done, while 3 others keep
    working. After each: our operations are not blocked, nothing of the dead
    is left, check() is empty."""
    mgr = make_pool(max_blocks=128, max_tables=256, max_refs=4096, **LAYOUT)
    rng = random.Random(1234)
    seeds = iter(range(100, 10_000))
    kills, scribble_kills, reclaimed_by_us = 0, 0, 0
    recoveries0 = mgr.pool.c[L.C_RECOVERIES]

    def new_random():
        w = spawn("random", mgr.name, next(seeds), 120)
        w.ready()
        return w

    live = [new_random() for _ in range(3)]
    for w in live:
        w.send("go")
    # spares attach while the others work, so a replacement is ready at once
    spare, scribbler = new_random(), start_scribbler(spawn, mgr.name)
    for round_ in range(21):
        if round_ % 4 == 3:
            # A process killed while holding the lock with half an update done.
            kind = SCRIBBLES[scribble_kills % len(SCRIBBLES)]
            s, scribbler = scribbler, None
            blocks = alloc_retrying(s, 3)
            s.call("create", rid="victim")
            s.call("add", rid="victim", block=blocks[0], tokens=BS)
            s.call("add", rid="victim", block=blocks[1], tokens=2)
            s.call("scribble", kind=kind)
            assert lock_is_held_elsewhere(mgr)
            s.kill()
            scribble_kills += 1
        else:
            victim = live.pop(rng.randrange(len(live)))
            # let it get into its work, then kill it at a random moment
            for _ in range(rng.randint(1, 3)):
                victim.expect("PROGRESS", timeout=30)
            time.sleep(rng.uniform(0, 0.02))      # randomises the moment, not a handshake
            victim.kill()
            assert victim.proc.returncode == -9, victim.stderr_text()
            spare.send("go")
            live.append(spare)
            spare = None
        kills += 1
        # Survivors are not blocked: our own next operations finish at once.
        n, elapsed = run_with_deadline(mgr.reclaim_dead, 10)
        assert elapsed < BLOCKED_BOUND
        reclaimed_by_us += n
        problems, elapsed = run_with_deadline(mgr.check, 10)
        assert problems == [] and elapsed < BLOCKED_BOUND
        assert dead_entries(mgr) == []
        spare = spare or new_random()
        scribbler = scribbler or start_scribbler(spawn, mgr.name)
        pids = {h["pid"] for h in mgr.holdings()}
        assert pids == {os.getpid(), spare.pid, scribbler.pid} | {w.pid for w in live}
    finished = []
    for w in live + [spare, scribbler]:
        w.stop()
    for w in live:
        finished.append(json.loads(w.expect("DONE", timeout=60)))
    for w in live + [spare, scribbler]:
        assert w.wait(timeout=30) == 0, w.stderr_text()
    assert kills >= 20 and scribble_kills >= 5
    for s in finished:
        assert s["steps"] > 0
        assert s["max_latency"] < BLOCKED_BOUND, s   # no survivor was ever blocked long
    assert mgr.pool.c[L.C_RECOVERIES] - recoveries0 >= scribble_kills
    assert mgr.pool.c[L.C_RECLAIMED] > 0 and reclaimed_by_us > 0
    assert mgr.check() == []
    assert mgr.free_blocks == mgr.max_blocks - 1
    assert len(mgr.request_tables) == 0
    assert [h["pid"] for h in mgr.holdings()] == [os.getpid()]


# ----------------------------------------------------- what the dead held
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sigkill", "os_exit", "close"])
def test_everything_a_departed_process_held_is_released(make_pool, spawn, how):
    mgr = make_pool(max_blocks=48, **LAYOUT)
    tokens = family_tokens(2, 3 * BS)
    rid, pub = publish(mgr, tokens)                  # the parent keeps this table
    before = ref_counts(mgr)
    free_before = mgr.free_blocks
    stats_before = mgr.get_stats()

    w = spawn("serve", mgr.name)
    slot = w.ready()
    want = build_holdings(w, tokens)
    h = next(x for x in mgr.holdings() if x["slot"] == slot)
    assert (h["tables"], h["table_blocks"], h["loose_blocks"]) == \
        (want["tables"], want["table_blocks"], want["loose_blocks"])
    assert h["pid"] == w.pid and h["alive"]
    assert (ref_counts(mgr)[pub] > before[pub]).all()   # it shares the parent's blocks
    total = want["table_blocks"] + want["loose_blocks"]

    if how == "close":
        w.call("close")
        assert w.alive()
        assert mgr.reclaim_dead() == 0               # nothing was left for recovery
    else:
        if how == "sigkill":
            w.kill()
        else:
            w.request("exit")
            w.wait(timeout=30)
        dead = dead_entries(mgr)
        assert len(dead) == 1 and dead[0]["slot"] == slot
        assert (dead[0]["tables"], dead[0]["table_blocks"], dead[0]["loose_blocks"]) == \
            (want["tables"], want["table_blocks"], want["loose_blocks"])
        assert mgr.reclaim_dead() == total
        assert mgr.reclaim_dead() == 0
    assert mgr.check() == []
    assert dead_entries(mgr) == []
    assert slot not in [x["slot"] for x in mgr.holdings()]
    assert (ref_counts(mgr) == before).all()
    assert mgr.free_blocks == free_before
    assert sorted(mgr.request_tables) == [rid]
    s = mgr.get_stats()
    assert (s.allocated_blocks, s.shared_blocks, s.tokens_held, s.refs_held) == \
        (stats_before.allocated_blocks, stats_before.shared_blocks, stats_before.tokens_held,
         stats_before.refs_held)
    assert os.path.exists(segment.path_for(mgr.name))    # leaving never removes the pool
    verify_blocks(mgr, pub, tokens, 0, "parent's table after the other left")
    if how == "close":
        w.stop()
        assert w.wait(timeout=30) == 0
    mgr.delete_block_table(rid)
    assert mgr.free_blocks == mgr.max_blocks - 1 and mgr.check() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_time", ["wrong", "matching"])
def test_reused_pid_is_not_taken_for_a_live_holder(make_pool, spawn, start_time):
    """Liveness is the OFD lock byte, not (pid, start time): a dead slot whose
    pid field names a live process (ours) is still reclaimed, and a live
    slot whose pid names a dead process is left alone."""
    mgr = make_pool(max_blocks=48, **LAYOUT)
    tokens = family_tokens(4, 2 * BS)
    rid, pub = publish(mgr, tokens)
    before = ref_counts(mgr)
    free_before = mgr.free_blocks

    doomed = spawn("serve", mgr.name)
    keeper = spawn("serve", mgr.name)
    dslot, kslot = doomed.ready(), keeper.ready()
    want = build_holdings(doomed, tokens)
    keeper.call("create", rid="kept")
    kept = keeper.call("alloc", n=1)
    keeper.call("add", rid="kept", block=kept[0], tokens=1)
    dead_pid = doomed.pid
    doomed.kill()

    slots = mgr.pool.slots
    # the dead slot now claims to be us, a live process
    slots["pid"][dslot] = os.getpid()
    slots["start_time"][dslot] = (psutil.Process().create_time() if start_time == "matching"
                                  else 12345.0)
    # the live slot claims to be the dead process
    slots["pid"][kslot] = dead_pid
    slots["start_time"][kslot] = 0.0
    h = {x["slot"]: x for x in mgr.holdings()}
    assert h[dslot]["alive"] is False and h[dslot]["pid"] == os.getpid()
    assert h[kslot]["alive"] is True

    assert mgr.reclaim_dead() == want["table_blocks"] + want["loose_blocks"]
    assert mgr.check() == []
    h = {x["slot"]: x for x in mgr.holdings()}
    assert dslot not in h and kslot in h
    assert keeper.call("table", rid="kept") == {"block_ids": kept, "num_tokens": 1}
    assert keeper.call("tables") == sorted([rid, "kept"])
    keeper.call("delete", rid="kept")
    assert (ref_counts(mgr) == before).all()
    assert mgr.free_blocks == free_before
    keeper.stop()
    assert keeper.wait(timeout=30) == 0
    mgr.delete_block_table(rid)
    assert mgr.check() == [] and mgr.free_blocks == mgr.max_blocks - 1


@pytest.mark.timeout(60)
def test_dead_slot_is_reused_by_a_new_attacher(make_pool, spawn):
    """Slots of dead processes are not leaked: a pool with max_slots=3 keeps
    serving attachers after many deaths."""
    mgr = make_pool(max_blocks=16, max_slots=3, **LAYOUT)
    for i in range(5):
        w = spawn("serve", mgr.name)
        w.ready()
        w.call("alloc", n=1)
        w.kill()
    w = spawn("serve", mgr.name)
    w.ready()
    assert w.call("check") == []
    w.stop()
    assert w.wait(timeout=30) == 0
    mgr.reclaim_dead()
    assert mgr.check() == [] and mgr.free_blocks == 15

"""Corrupted segments never crash or hang a process.

A small live pool (tables, a fork, cached free blocks, loose and acquired
references, K/V) is copied many times; each copy gets a few random byte
flips or odd int32 values in its header, counters, slots, block records,
indexes, reference records or tables, and a subprocess then runs on it:
``shmcache fsck`` (read-only: it must not change a byte, even of a corrupt
pool), ``shmcache inspect``, attach, ``check()``, the operations a worker
makes, ``fsck --repair``. Each step must work or raise a clear Python error
(``ShmCacheError``, ``ValueError``, ``KeyError``, ``TypeError``): never a
signal death, never a hang (each case runs under an alarm whose default
action kills the process, so a hang even inside C is seen).

The cases are seeded (``FUZZ_SEED``, ``FUZZ_CASES``, ``FUZZ_FLIPS`` the most
changes per case, to change them; ``FUZZ_SHOW=1`` with ``-s`` prints each kind
of error met); half run with the C accelerator, half with ``SHMCACHE_PURE=1``
(ctypes and Python). 200 cases take a few seconds.
This file is also the subprocess: ``python test_fuzz_segment.py SPEC FIRST
STEP COUNT``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

CASE_ALARM_S = 20
ALLOWED = ("ShmCacheError", "ValueError", "KeyError", "TypeError")
INT32_VALUES = (-1, -2, 0, 1, 2, 3, 7, 2**31 - 1, -2**31, 2**16, 2**24)


# ============================================================== the subprocess
def _flip(data: bytearray, spec: dict, rng: random.Random) -> list:
    """Corrupt ``data`` in place: 1 to spec["flips"] changes; returns what was done."""
    regions = spec["regions"]
    names = list(regions)
    weights = [spec["weights"][n] for n in names]
    done = []
    for _ in range(rng.randint(1, spec["flips"])):
        name = rng.choices(names, weights)[0]
        lo, hi = regions[name]
        if rng.random() < 0.5:
            off = rng.randrange(lo, hi)
            x = rng.randrange(1, 256)
            data[off] ^= x
            done.append(f"{name}+{off - lo}^={x}")
        else:
            off = lo + rng.randrange(0, (hi - lo) // 4) * 4
            n = spec["max_blocks"]
            v = rng.choice(INT32_VALUES + (n - 1, n, n + 1, n + 2, spec["num_chunks"],
                                           spec["num_chunks"] - 1))
            data[off:off + 4] = int(v).to_bytes(4, "little", signed=True)
            done.append(f"{name}+{off - lo}={v}")
    return done


def _case(spec: dict, data: bytes, i: int) -> None:
    import mlx.core as mx

    import shmcache
    from shmcache import cli
    from shmcache.shm import segment

    rng = random.Random(spec["seed"] * 100003 + i)
    buf = bytearray(data)
    flips = _flip(buf, spec, rng)
    name = f"{spec['base']}-c{i}"
    path = segment.path_for(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(buf))
    finally:
        os.close(fd)
    steps = []
    state: dict = {}

    def step(label, fn):
        print(f"S {i} {label}", flush=True)
        try:
            out = fn()
            steps.append([label, "ok", ""])
            return out
        except Exception as e:      # what we judge: the class and its message
            kind = next((c.__name__ for c in type(e).__mro__ if c.__name__ in ALLOWED),
                        type(e).__name__)
            steps.append([label, kind, f"{type(e).__name__}: {e}"[:300]])
            return None

    def fsck(*extra, cmd="fsck"):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main([cmd, name, *extra])
        if rc not in (0, 1, 2):
            raise RuntimeError(f"fsck exit code {rc}")
        if "Traceback" in out.getvalue() + err.getvalue():
            raise RuntimeError("fsck printed a traceback")
        if rc == 2 and len(err.getvalue().strip().splitlines()) != 1:
            raise RuntimeError(f"fsck error is not one line: {err.getvalue()!r}")
        return rc

    def fsck_read_only():
        with open(path, "rb") as f:
            before = f.read()
        rc = fsck()
        with open(path, "rb") as f:
            if f.read() != before:
                raise RuntimeError("fsck without --repair changed the segment")
        return rc

    signal.alarm(CASE_ALARM_S)
    try:
        step("fsck", fsck_read_only)
        step("inspect", lambda: fsck("--json", cmd="inspect"))
        m = state["m"] = step("attach", lambda: shmcache.attach(name, timeout=2.0))
        if m is not None:
            toks = spec["tokens"]
            k = mx.array(np.ones((1, 4, 8), np.float32))
            step("check", m.check)
            b = step("allocate_block", m.allocate_block)
            got = step("get_new_blocks", lambda: m.get_new_blocks(3)) or []
            if b is not None:
                step("free_block", lambda: m.free_block(b.block_id))
            if len(got) == 3:
                step("free_block_batch", lambda: m.free_block_batch(got[:2]))
                t = step("create_block_table", lambda: m.create_block_table("fz"))
                if t is not None:
                    step("add_block_to_table", lambda: m.add_block_to_table(t, got[2], 4))
                    step("write_kv", lambda: m.write_kv(got[2].block_id, 0, k, k))
            acq = step("acquire_computed_blocks", lambda: m.acquire_computed_blocks(toks))
            t2 = step("create_block_table 2", lambda: m.create_block_table("fz2"))
            if t2 is not None:
                new = step("prepare_append", lambda: m.prepare_append(t2, 8))
                if new:
                    step("cache_full_blocks",
                         lambda: m.cache_full_blocks(new, list(range(500, 508)), 0, 2))
            t0 = step("get_block_table", lambda: m.get_block_table("t0"))
            if t0 is not None:
                ids = step("block_ids", lambda: t0.block_ids)
                if ids:
                    step("read_kv", lambda: m.read_kv(ids, 0))
                step("fork_block_table", lambda: m.fork_block_table(t0, "fz3"))
                step("prepare_append t0", lambda: m.prepare_append(t0, 3))
                step("get_blocks_for_generation", lambda: m.get_blocks_for_generation(t0))
            step("delete_block_table", lambda: m.delete_block_table("t1"))
            step("get_computed_blocks", lambda: m.get_computed_blocks(toks))
            step("find_shared_prefix", lambda: m.find_shared_prefix(toks))
            step("evict_lru_blocks", lambda: m.evict_lru_blocks(2))
            step("free queue", lambda: m.free_block_queue.get_all_free_blocks())
            step("increment_ref", lambda: m.increment_ref(3))
            step("touch", lambda: m.touch([4, 5]))
            step("holdings", m.holdings)
            step("memory usage", m.get_memory_usage)
            step("tables", lambda: {r: (t.block_ids, t.num_tokens, len(t))
                                    for r, t in m.request_tables.items()})
            if acq:
                step("free acquired", lambda: m.free_block_batch(acq[0]))
            step("get_stats", m.get_stats)
            step("reclaim_dead", m.reclaim_dead)
            step("check again", m.check)
            step("close", m.close)
        step("fsck --repair", lambda: fsck("--repair"))
    finally:
        signal.alarm(0)
        segment.unlink(name)
    print("R " + json.dumps({"case": i, "flips": flips, "steps": steps}), flush=True)


def worker_main(argv) -> None:
    spec_path, first, stride, count = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    with open(spec_path) as f:
        spec = json.load(f)
    with open(spec["data"], "rb") as f:
        data = f.read()
    import logging
    logging.disable(logging.CRITICAL)           # repairs log warnings: expected here
    signal.signal(signal.SIGALRM, signal.SIG_DFL)   # a hang, even in C, ends the process
    for j in range(count):
        _case(spec, data, first + j * stride)


# ================================================================== the test
def _template(make_pool):
    from _helpers import cached_table
    import mlx.core as mx

    m = make_pool(block_size=4, max_blocks=48, num_layers=1, num_kv_heads=1, head_dim=8,
                  dtype="float32", max_slots=4, max_tables=8, max_refs=160)
    t0, ids, tokens = cached_table(m, "t0", 4)
    for b in ids:
        m.write_kv(b, 0, mx.ones((1, 4, 8)), mx.ones((1, 4, 8)))
    f = m.fork_block_table(t0, "t1")
    m.prepare_append(f, 2)                  # the fork gets a block of its own
    cached_table(m, "t2", 3, base=100)
    m.delete_block_table("t2")              # cached free blocks
    m.get_new_blocks(2)                     # loose references
    m.acquire_computed_blocks(tokens)       # loose references to cached blocks
    assert m.check() == []
    return m, tokens


def _regions(lay) -> dict:
    from shmcache.shm import layout as L
    return {
        "header": (0, L.HEADER_DTYPE.itemsize),
        "counters": (lay.counters_off, lay.counters_off + 16 * 8),
        "slots": (lay.slots_off, lay.slots_off + lay.max_slots * L.SLOT_DTYPE.itemsize),
        "blocks": (lay.blocks_off, lay.blocks_off + (lay.max_blocks + 2) * L.BLOCK_DTYPE.itemsize),
        "hash index": (lay.hash_off, lay.hash_off + lay.hash_capacity * 4),
        "refs": (lay.refs_off, lay.refs_off + lay.num_chunks * L.CHUNK_DTYPE.itemsize),
        "tables": (lay.tables_off, lay.tables_off + lay.max_tables * L.TABLE_DTYPE.itemsize),
        "table index": (lay.tindex_off, lay.tindex_off + lay.table_capacity * 4),
    }


def _run_batch(spec_path, first, stride, count, env, results, failures):
    """Run cases first, first+stride, ... in subprocesses (a new one after a death)."""
    todo = [first + j * stride for j in range(count)]
    while todo:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), spec_path, str(todo[0]),
                            str(stride), str(len(todo))],
                           capture_output=True, text=True, env=env,
                           timeout=CASE_ALARM_S * len(todo) + 60)
        current = None
        for line in p.stdout.splitlines():
            if line.startswith("S "):
                current = line.split(" ", 2)[1:]
            elif line.startswith("R "):
                r = json.loads(line[2:])
                results.append(r)
                todo.remove(r["case"])
                current = None
        if p.returncode != 0:
            if current is None:
                failures.append(f"worker exited {p.returncode} between cases: {p.stderr[-2000:]}")
                return
            case = int(current[0])
            sig = -p.returncode
            what = ("hung (killed by its alarm)" if sig == signal.SIGALRM
                    else f"died of signal {sig}" if sig > 0 else f"exited {p.returncode}")
            failures.append(f"case {case}: {what} in step {current[1]!r}: {p.stderr[-1500:]}")
            todo.remove(case)


def test_corrupted_segments_never_crash_or_hang(make_pool, tmp_path):
    from conftest import new_name

    m, tokens = _template(make_pool)
    lay = m.layout
    data = tmp_path / "segment"
    with open(segment_path(m.name), "rb") as f:
        data.write_bytes(f.read())
    cases = int(os.environ.get("FUZZ_CASES", "200"))
    spec = {"seed": int(os.environ.get("FUZZ_SEED", "12")), "data": str(data),
            "flips": int(os.environ.get("FUZZ_FLIPS", "3")),
            "base": new_name("fuzz"), "tokens": tokens, "regions": _regions(lay),
            "weights": {"header": 1, "counters": 2, "slots": 1, "blocks": 3, "hash index": 1,
                        "refs": 3, "tables": 2, "table index": 1},
            "max_blocks": lay.max_blocks, "num_chunks": lay.num_chunks}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    envs = []
    for pure in (False, True):
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.path.join(root, "tests"))
        env.pop("SHMCACHE_PURE", None)
        if pure:
            env["SHMCACHE_PURE"] = "1"
        envs.append(env)
    results, failures = [], []
    t0 = time.monotonic()
    import threading
    threads = [threading.Thread(target=_run_batch,
                                args=(str(spec_path), w, 2, (cases - w + 1) // 2, envs[w],
                                      results, failures))
               for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    for r in results:
        for label, kind, msg in r["steps"]:
            if kind not in ("ok",) + ALLOWED:
                failures.append(f"case {r['case']} ({', '.join(r['flips'])}): {label}: {msg}")
    assert not failures, "\n".join(failures[:20])
    assert len(results) == cases
    # the fuzz reached past attach in most cases, and refused some
    attached = sum(1 for r in results if any(s[0] == "attach" and s[1] == "ok" for s in r["steps"]))
    assert cases // 4 < attached < cases, attached
    counts: dict = {}
    for r in results:
        for label, kind, _ in r["steps"]:
            counts.setdefault(label, {}).setdefault(kind, 0)
            counts[label][kind] += 1
    print(f"{cases} cases in {elapsed:.1f} s; attached {attached}; {counts}")
    if os.environ.get("FUZZ_SHOW"):
        seen = set()
        for r in results:
            for label, kind, msg in r["steps"]:
                key = (label, msg.split(":")[0], msg[:60])
                if kind != "ok" and key not in seen:
                    seen.add(key)
                    print(r["case"], label, msg)


# ========================================================== a live pool
#
# The cases above corrupt a copy that one process then uses. Here words of a
# pool are corrupted while other processes use it (two with the C
# accelerator, one pure): table claims naming a live slot, the lock word
# naming a live process that never attached, a zombie or a dead thread,
# table owners, and odd int32s in the records, indexes, chunks and
# counters. Every worker must keep finishing steps (an operation done, or a
# clear error) with no gap longer than LIVE_GAP_S, never hang (an alarm
# kills it) or die, and ``fsck --repair`` must then leave the pool
# consistent.

LIVE_S = 3.0            # how long the words are corrupted
LIVE_GAP_S = 15.0       # the longest a worker may go without finishing a step (a lock
                        # word is taken over after 3 s, a claim after 1 s, each behind
                        # the lock, on a shared 2-core machine)

LIVE_WORKER = r"""
import json, signal, sys, time
import shmcache
name, me, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
ALLOWED = ("ShmCacheError", "ValueError", "KeyError", "TypeError")
signal.signal(signal.SIGALRM, signal.SIG_DFL)       # a hang, even in C, ends the process
signal.alarm(int(until - time.time()) + 40)
import logging
logging.disable(logging.CRITICAL)                   # repairs log warnings: expected here
m = shmcache.attach(name)
print("ready", flush=True)
last, gap, steps, errors, bad = time.monotonic(), 0.0, 0, {}, []

def step(fn):
    global last, gap, steps
    try:
        return fn()
    except Exception as e:
        kind = next((c.__name__ for c in type(e).__mro__ if c.__name__ in ALLOWED), None)
        if kind is None:
            bad.append(f"{type(e).__name__}: {e}"[:300])
        errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
    finally:
        now = time.monotonic()
        gap = max(gap, now - last)
        last = now
        steps += 1

i = 0
while time.time() < until:
    rid = f"w{me}-{i}"
    i += 1
    t = step(lambda: m.create_block_table(rid))
    if t is not None:
        step(lambda: m.prepare_append(t, 5))
        for _ in range(3):
            step(lambda: m.prepare_append(t, 1))
        step(lambda: list(t.block_ids))
    got = step(lambda: m.get_new_blocks(2))
    if got:
        step(lambda: m.free_block_batch(got))
    step(lambda: m.get_computed_blocks(list(range(8))))
    step(lambda: m.delete_block_table(rid))
step(m.close)
print(json.dumps({"steps": steps, "gap": gap, "errors": errors, "bad": bad}), flush=True)
"""


def test_a_live_pool_with_corrupted_words_hangs_nobody(make_pool):
    import random
    import select

    from shmcache.shm import layout as L

    m = make_pool(block_size=4, max_blocks=64, max_slots=8, max_tables=16)
    lay, p = m.layout, m.pool
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    until = time.time() + LIVE_S + 2.0
    workers = []
    for w, pure in enumerate((False, False, True)):
        env = dict(os.environ, PYTHONPATH=root)
        env.pop("SHMCACHE_PURE", None)
        if pure:
            env["SHMCACHE_PURE"] = "1"
        workers.append(subprocess.Popen([sys.executable, "-c", LIVE_WORKER, m.name, str(w),
                                         str(until)], stdout=subprocess.PIPE, text=True,
                                        env=env))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rng = random.Random(int(os.environ.get("FUZZ_SEED", "12")))
    done = []
    try:
        for w in workers:
            r, _, _ = select.select([w.stdout], [], [], 60)
            assert r and w.stdout.readline().strip() == "ready"
        word = lambda off: np.frombuffer(p.mm, np.int32, 1, off)
        regions = _regions(lay)
        del regions["header"]           # (checked at attach: fsck --repair would refuse)
        lock_words = [sleeper.pid, zombie.pid, dead.pid]
        end = time.monotonic() + LIVE_S
        while time.monotonic() < end:
            kind = rng.choice(["claim", "claim", "owner", "words", "words", "words", "lock"])
            live = np.flatnonzero(p.slots["state"] == 1).tolist() or [0]
            t = rng.randrange(lay.max_tables)
            if kind == "claim":
                p.t_claim[t] = rng.choice(live) + 1 if rng.random() < 0.7 else rng.choice(
                    INT32_VALUES)
            elif kind == "owner":
                p.t_owner[t] = rng.choice(INT32_VALUES + (lay.max_slots - 1,))
            elif kind == "lock" and lock_words:
                np.frombuffer(p.mm, np.uint32, 1, L.MUTEX_OFF)[0] = lock_words.pop(0)
            else:
                name = rng.choice(list(regions))
                lo, hi = regions[name]
                off = lo + rng.randrange(0, (hi - lo) // 4) * 4
                word(off)[0] = rng.choice(INT32_VALUES + (lay.max_blocks - 1, lay.max_blocks,
                                                          lay.num_chunks))
            done.append(kind)
            time.sleep(0.1)
        results = []
        for w in workers:
            out, _ = w.communicate(timeout=LIVE_GAP_S + 60)
            assert w.returncode == 0, f"a worker died (exit {w.returncode}): a hang or a crash"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for x in workers + [sleeper]:
            x.kill()
            x.wait(timeout=10)
        zombie.wait(timeout=10)
    for r in results:
        assert not r["bad"], r["bad"]
        assert r["steps"] > 10 and r["gap"] < LIVE_GAP_S, r
    from shmcache import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["fsck", "--repair", m.name])
    assert rc == 0, out.getvalue()
    assert m.check() == []
    print(f"{len(done)} corruptions ({', '.join(sorted(set(done)))}); "
          f"{[(r['steps'], round(r['gap'], 2), r['errors']) for r in results]}")


def segment_path(name: str) -> str:
    from shmcache.shm import segment
    return segment.path_for(name)


if __name__ == "__main__":
    worker_main(sys.argv[1:])

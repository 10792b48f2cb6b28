"""Pool benchmark, items 4 and 5 (see :mod:`tools.bench.pool` for the whole list).

4. Creating a 1,000,000-block pool, and the metadata bytes per block, against
   the seed's ``PagedCacheManager(max_blocks=1_000_000)``.
5. Aggregate batched throughput of 2 worker processes against 1. A worker is
   started on its own as ``python -m tools.bench.pool --worker NAME`` (which
   runs :func:`worker_main` here) and attaches to the pool by name.

:func:`tools.bench.pool.run` calls :func:`bench_create` and
:func:`bench_scaling`; this module uses its helpers.
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import threading
import time

import shmcache
from shmcache.shm import segment
from tools.bench.table import row
from tools.bench.pool_fixtures import BATCH, PREFIX, ROOT, Pools, perf, seed_batch_free


# ----------------------------------------------------------------- item 4
def bench_create(seed, trials: int) -> list:
    nb = 1_000_000
    rows = []

    def create_ours(**kw):
        name = f"{PREFIX}big"
        gc.collect()
        t0 = perf()
        c = shmcache.create_pool(name, max_blocks=nb, **kw)
        t1 = perf()
        try:
            a0 = perf()
            a = shmcache.attach(name)
            a1 = perf()
            a.close()
            return t1 - t0, a1 - a0, c.layout
        finally:
            c.destroy()

    def create_seed():
        gc.collect()
        t0 = perf()
        m = seed.PagedCacheManager(max_blocks=nb)
        t = perf() - t0
        del m
        gc.collect()
        return t

    t_meta, t_attach, t_seed, t_full = [], [], [], []
    lay0 = lay1 = None
    for i in range(trials):
        t, ta, lay0 = create_ours(num_layers=0)
        t_meta.append(t)
        t_attach.append(ta)
        if seed:
            t_seed.append(create_seed())
    # default layout: reserve the KV arena too (skip if /dev/shm is too small)
    from shmcache.shm import layout as L
    probe = L.compute_layout(64, nb, True, 1, 1, 8, "float16", 64, 4096, 2 * nb + 256)
    st = os.statvfs(segment.SHM_DIR)
    full_note = ""
    if st.f_bavail * st.f_frsize > 1.5 * probe.total_size:
        for i in range(max(1, trials - 1)):
            t, _, lay1 = create_ours()
            t_full.append(t)
    else:
        full_note = f"skipped: /dev/shm has less than 1.5x {probe.total_size:,} bytes free"

    seed_bytes = seed_rss = None
    if seed:
        import tracemalloc

        import psutil
        proc = psutil.Process()
        gc.collect()
        rss0 = proc.memory_info().rss
        tracemalloc.start()
        b0 = tracemalloc.get_traced_memory()[0]
        keep = [seed.PagedCacheManager(max_blocks=nb)]
        seed_bytes = (tracemalloc.get_traced_memory()[0] - b0) / nb
        tracemalloc.stop()
        seed_rss = (proc.memory_info().rss - rss0) / nb
        keep.clear()
        gc.collect()

    med = statistics.median
    ts = med(t_seed) if t_seed else None
    rows.append(row("4.  create 1M-block pool, metadata only (num_layers=0)", med(t_meta), ts,
                    unit="s", target=("<=", 0.1),
                    note="ours shmcache.create_pool(max_blocks=1_000_000, num_layers=0); "
                         "seed PagedCacheManager(max_blocks=1_000_000)"))
    if t_full:
        rows.append(row(f"4b. create 1M-block pool, default KV layout "
                        f"({lay1.arena_size / 2**30:.2f} GiB arena)", med(t_full), ts, unit="s",
                        note="default layout: num_layers=1, num_kv_heads=1, head_dim=8, float16, "
                             "block_size=64; the arena is reserved with posix_fallocate"))
    else:
        rows.append(row("4b. create 1M-block pool, default KV layout", None, ts, unit="s",
                        note=full_note))
    rows.append(row("4c. attach to a 1M-block pool (info)", med(t_attach), None, unit="s"))
    rows.append(row("4.  metadata bytes per block (1M blocks)", lay0.metadata_size / nb,
                    seed_bytes, unit="B", target=("<=", 64), on="ours",
                    note=_meta_note(lay0, nb) + (f"; seed: tracemalloc (Python heap) per block, "
                                                 f"RSS delta {seed_rss:.1f} B/block"
                                                 if seed else "")))
    if lay1 is not None:
        rows.append(row("4d. KV arena bytes per block, default layout (info)",
                        lay1.arena_size / nb, None, unit="B",
                        note=f"metadata with the default layout: {lay1.metadata_size / nb:.1f} B/block "
                             "(same sections); the seed keeps no KV arena of its own"))
    return rows


def _meta_note(lay, nb) -> str:
    parts = [("blocks", lay.hash_off - lay.blocks_off), ("prefix index", lay.refs_off - lay.hash_off),
             ("refs (chunks)", lay.tables_off - lay.refs_off),
             ("tables+index", lay.arena_off - lay.tables_off),
             ("header+slots", lay.blocks_off)]
    return "ours per block: " + ", ".join(f"{k} {v / nb:.1f}" for k, v in parts)


# ----------------------------------------------------------------- item 5
class Worker:
    """A benchmark worker process, started on its own, that attaches by name."""

    def __init__(self, name: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "tools.bench.pool", "--worker", name],
                                  cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1)

    def expect(self, what: str) -> str:
        line = self.p.stdout.readline()
        if not line.startswith(what):
            raise RuntimeError(f"bench worker {self.p.pid}: expected {what!r}, got {line!r} "
                               f"(exit code {self.p.poll()})")
        return line[len(what):].strip()

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.send("quit")
                self.p.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def worker_main(name: str) -> int:
    m = shmcache.attach(name)
    try:
        get, free = m.get_new_blocks, m.free_block_batch
        print("ready", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            start, dur = float(cmd[1]), float(cmd[2])
            for _ in range(20):
                free(get(BATCH))
            while (d := start - time.monotonic()) > 0:
                time.sleep(min(d, 0.001) if d < 0.01 else d - 0.005)
            end, n = start + dur, 0
            while True:
                free(get(BATCH))
                n += 1
                if time.monotonic() >= end:
                    break
            print(f"done {n * BATCH} {time.monotonic() - start}", flush=True)
    finally:
        m.close()
    return 0


def _ours_throughput(workers, k: int, dur: float) -> float:
    start = time.monotonic() + 0.15
    for w in workers[:k]:
        w.send(f"run {start} {dur}")
    tot = 0.0
    for w in workers[:k]:
        blocks, el = w.expect("done").split()
        tot += int(blocks) / float(el)
    return tot


def _seed_throughput(sm, free_batch, k: int, dur: float) -> float:
    get, out = sm.get_new_blocks, []
    barrier = threading.Barrier(k)

    def body():
        barrier.wait()
        t0 = time.monotonic()
        end, n = t0 + dur, 0
        while True:
            free_batch(get(BATCH))
            n += 1
            if time.monotonic() >= end:
                break
        out.append(n * BATCH / (time.monotonic() - t0))
    ts = [threading.Thread(target=body) for _ in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(out)


def bench_scaling(seed, pools: Pools, trials: int, dur: float) -> list:
    name, ours = pools.create("scale", max_blocks=1000)
    workers = []
    try:
        workers = [Worker(name) for _ in range(2)]
        for w in workers:
            w.expect("ready")
        one, two = [], []
        for i in range(trials):
            for k in ((1, 2) if i % 2 == 0 else (2, 1)):
                (one if k == 1 else two).append(_ours_throughput(workers, k, dur))
    finally:
        for w in workers:
            w.stop()
    s1 = s2 = None
    if seed:
        sm = seed.PagedCacheManager(max_blocks=1000)
        sfree, _ = seed_batch_free(sm)
        _seed_throughput(sm, sfree, 1, 0.1)
        a, b = [], []
        for i in range(max(1, trials // 2 + 1)):
            a.append(_seed_throughput(sm, sfree, 1, dur / 2))
            b.append(_seed_throughput(sm, sfree, 2, dur / 2))
        s1, s2 = statistics.median(a), statistics.median(b)
    problems = ours.check()
    if problems:
        raise AssertionError(f"pool inconsistent after item 5: {problems[:5]}")
    med = statistics.median
    o1, o2 = med(one), med(two)
    return [
        row("5a. batched 64-block alloc+free, 1 process, blocks/s", o1, s1, unit="ops/s",
            note=f"{trials} trials of {dur:g} s per process count; seed column: threads "
                 "sharing one seed manager in this process (GIL-bound), for reference"),
        row("5b. same, 2 processes (aggregate)", o2, s2, unit="ops/s"),
        row("5.  aggregate throughput, 2 processes / 1", o2 / o1, s2 / s1 if seed else None,
            unit="x", ratio=False, target=(">=", 1.3), on="ours",
            note="seed figure is 2 threads / 1 thread"),
    ]

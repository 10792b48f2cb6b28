"""Benchmark section "workers": the read a worker makes of the shared pool.

``read_kv`` gather bandwidth (the read evaluated) against a plain numpy copy
of the same bytes into a preallocated buffer (target >= 0.6 of it), for 512
blocks (a long context) and 64 (a 2,048-token one), each timed on its own
(both warm) and timed turn about, with the demo model's K/V shape (4 KV
heads of 32).

(The section's TTFT and PSS rows measured the former toy workers; what the
prefix cache buys ``shmcache serve`` now shows in ``make run``'s report.)
"""

from __future__ import annotations

import time

import numpy as np

from tools.bench.table import row

BS = 32
SECTION = "workers"
KV_HEADS, HEAD_DIM = 4, 32       # the demo model's (and the former toy model's) K/V shape


def bench_gather() -> list:
    import mlx.core as mx

    import shmcache
    rows = []
    for dtype in ("float32", "float16"):
        mgr = shmcache.PagedCacheManager(block_size=BS, max_blocks=2048, num_layers=1,
                                         num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                         dtype=dtype)
        try:
            mgr.pool.arena[...] = 1
            for n in (512, 64):
                ids = np.random.default_rng(0).permutation(np.arange(1, 2048))[:n].tolist()
                nbytes = 2 * mgr.pool.arena[0, ids, 0].nbytes
                src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
                dst = np.empty_like(src)

                def ours():
                    mx.eval(*mgr.read_kv(ids, 0))

                def plain():
                    np.copyto(dst, src)
                what = f"read_kv gather, {n} blocks, {dtype} ({nbytes >> 10} KiB)"
                # NOTE: 101 calls (each under 4 ms): with 15, the median of
                # the 1 MiB case swung 0.43x-0.73x between runs here.
                rows.append(row(what, nbytes / _best(ours, 101) / 1e9,
                                nbytes / _best(plain, 101) / 1e9, unit="GB/s", target=(">=", 0.6),
                                section=SECTION,
                                note="seed column: np.copyto of the same number of bytes; "
                                     "each timed on its own, warm"))
                t_ours, t_plain = _alternating(ours, plain, 101)
                rows.append(row(what + ", alternating", nbytes / t_ours / 1e9,
                                nbytes / t_plain / 1e9, unit="GB/s", target=(">=", 0.6),
                                section=SECTION,
                                note="the same two, timed turn about, so that each finds "
                                     "the cache as the other left it"))
        finally:
            mgr.close()
    return rows


def _alternating(a, b, reps=31):
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for fn, ts in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return float(np.median(ta)), float(np.median(tb))


def _best(fn, reps=15) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def run(args) -> list:
    return bench_gather()

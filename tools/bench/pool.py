"""Pool benchmark: shmcache through an attached manager against the seed.

The seed is ``vllm_mlx.paged_cache`` from ``vllm-mlx==0.6.0`` (installed by
``make bench`` with ``--no-deps``; never a dependency of shmcache), run in
this process. shmcache is measured through a manager from
``shmcache.attach(name)`` over a pool made by ``shmcache.create_pool`` (the
worker processes of item 5 attach by name on their own).

Measured, interleaving the two implementations trial by trial and reporting
the median of the trials (each trial runs many repetitions after a warm-up):

1. ``allocate_block()`` + ``free_block(b.block_id)``, per pair.
2. ``get_new_blocks(64)`` + a batch free of those blocks, per block. The
   seed's batch free is whatever ``type(mgr).__dict__`` offers as a function:
   ``free_block_batch`` in 0.6.0, else ``free_blocks`` if it is not shadowed
   by the property, else ``free_block`` in a loop (the row's note says which).
3. Prefix cache, block_size 16, a 64-block (1024-token) request: with 64
   freshly allocated blocks and a token sequence never seen before,
   ``cache_full_blocks(blocks, tokens, 0, 64)`` (fresh insert), then
   ``get_computed_blocks(tokens)`` (a full 64-block hit), each per block, and
   their sum; between repetitions the blocks are freed and the prefix cache
   reset (untimed). Info row: lookup + taking references, shmcache's atomic
   ``acquire_computed_blocks`` against the seed's ``get_computed_blocks`` +
   ``touch``.
4. Creating a 1,000,000-block pool: the time of ``create_pool`` (metadata
   only, ``num_layers=0``, which is what the seed builds; and with the default
   KV layout) against ``PagedCacheManager(max_blocks=1_000_000)``; metadata
   bytes per block (``layout.metadata_size / max_blocks``) against the
   seed's Python heap per block (tracemalloc; RSS delta in the note).
5. Aggregate batched throughput (``get_new_blocks(64)`` + ``free_block_batch``,
   counted in blocks per second) of 2 worker processes against 1, each
   started on its own with ``python -m tools.bench.pool --worker NAME`` and
   attaching by name, all running over the same wall-clock window. The seed
   column gives, for reference, 1 and 2 threads sharing one seed manager (the
   only way the seed can be shared).

Items 4 and 5 (with the ``--worker`` process mode) are in
``tools/bench/pool_scale.py``; :func:`run` here runs all five. What the items
share (the seed, the pools, the timing loops) is ``tools/bench/pool_fixtures.py``.

``python -m tools.bench.pool --profile`` profiles items 1, 2 and 3 for
shmcache (cProfile, plus a break-down of the fixed cost of one locked call);
that is ``tools/bench/pool_profile.py``.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys

try:
    import tools.bench  # noqa: F401
except ImportError:  # run as a file
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench.pool_fixtures import (BATCH, Pools, batch_loop, interleaved, load_seed, log,
                                       pair_loop, perf, seed_batch_free)
from tools.bench.pool_scale import bench_create, bench_scaling
from tools.bench.table import row


# ------------------------------------------------------------- items 1, 2
def bench_alloc(seed, pools: Pools, trials: int, target_s: float) -> list:
    _, ours = pools.create("alloc", max_blocks=1000)
    rows = []
    sm = seed.PagedCacheManager(max_blocks=1000) if seed else None
    fns = {"ours": pair_loop(ours)}
    if sm:
        fns["seed"] = pair_loop(sm)
    r = interleaved(fns, trials, target_s)
    rows.append(row("1. allocate_block + free_block, per pair", r["ours"] * 1e6,
                    r.get("seed", 0) * 1e6 or None, unit="us", target=("<=", 2.0)))
    how = "n/a"
    fns = {"ours": batch_loop(ours, ours.free_block_batch)}
    if sm:
        sfree, how = seed_batch_free(sm)
        fns["seed"] = batch_loop(sm, sfree)
    r = interleaved(fns, trials, target_s, per=BATCH)
    rows.append(row("2. get_new_blocks(64) + batch free, per block", r["ours"] * 1e6,
                    r.get("seed", 0) * 1e6 or None, unit="us", target=("<=", 1.0),
                    note=f"ours free_block_batch(blocks); {how}"))
    problems = ours.check()
    if problems:
        raise AssertionError(f"pool inconsistent after items 1-2: {problems[:5]}")
    return rows


# ----------------------------------------------------------------- item 3
def bench_prefix(seed, pools: Pools, trials: int, reps: int) -> list:
    bs, nblk = 16, 64
    _, ours = pools.create("prefix", block_size=bs, max_blocks=1024)
    impls = {"ours": (ours, ours.free_block_batch, ours.acquire_computed_blocks)}
    if seed:
        sm = seed.PagedCacheManager(block_size=bs, max_blocks=1024)
        sfree, _ = seed_batch_free(sm)

        def seed_acquire(tokens, _g=sm.get_computed_blocks, _t=sm.touch):
            blocks, n = _g(tokens)
            _t(blocks)
            return blocks, n
        impls["seed"] = (sm, sfree, seed_acquire)
    rng = random.Random(1234)

    def tokens():
        return [rng.randrange(50_000) for _ in range(bs * nblk)]

    def one_trial(impl, seqs):
        m, free_batch, acquire = impl
        tc = tl = ta = 0.0
        for toks in seqs:
            blocks = m.get_new_blocks(nblk)
            t0 = perf()
            m.cache_full_blocks(blocks, toks, 0, nblk)
            t1 = perf()
            found, ntok = m.get_computed_blocks(toks)
            t2 = perf()
            acq, _ = acquire(toks)
            t3 = perf()
            if len(found) != nblk or ntok != nblk * bs or len(acq) != nblk:
                raise AssertionError(f"expected a {nblk}-block hit, got {len(found)}/{len(acq)}")
            tc, tl, ta = tc + t1 - t0, tl + t2 - t1, ta + t3 - t2
            free_batch(acq)
            free_batch(blocks)
            if not m.reset_prefix_cache():
                raise AssertionError("reset_prefix_cache refused: blocks still in use")
        k = len(seqs) * nblk
        return tc / k, tl / k, ta / k

    for impl in impls.values():   # warm up
        one_trial(impl, [tokens() for _ in range(3)])
    res = {k: ([], [], []) for k in impls}
    keys = list(impls)
    for i in range(trials):
        seqs = [tokens() for _ in range(reps)]   # the same new sequences for both
        for k in (keys if i % 2 == 0 else keys[::-1]):
            gc.collect()
            for acc, v in zip(res[k], one_trial(impls[k], seqs)):
                acc.append(v)
    med = {k: [statistics.median(a) * 1e6 for a in v] for k, v in res.items()}
    sums = {k: statistics.median([a + b for a, b in zip(v[0], v[1])]) * 1e6 for k, v in res.items()}
    s = med.get("seed", [None] * 3)
    problems = ours.check()
    if problems:
        raise AssertionError(f"pool inconsistent after item 3: {problems[:5]}")
    return [
        row("3a. cache_full_blocks (fresh insert), per 16-token block", med["ours"][0], s[0], unit="us",
            note=f"64-block requests of new random tokens, {reps} per trial; blocks freed and "
                 "prefix cache reset between requests (untimed)"),
        row("3b. get_computed_blocks (full hit), per block", med["ours"][1], s[1], unit="us"),
        row("3.  cache_full_blocks + get_computed_blocks, per block", sums["ours"],
            sums.get("seed"), unit="us", target=("<=", 0.5)),
        row("3c. lookup + take refs, per block (info)", med["ours"][2], s[2], unit="us",
            note="ours acquire_computed_blocks (atomic); seed get_computed_blocks + touch"),
    ]


# --------------------------------------------------------------------- run
def add_args(ap) -> None:
    ap.add_argument("--pool-trials", type=int, default=7, help="trials per micro-benchmark")
    ap.add_argument("--scale-seconds", type=float, default=1.0,
                    help="length of one throughput trial of item 5")


def run(args) -> list:
    quick = getattr(args, "quick", False)
    trials = 3 if quick else getattr(args, "pool_trials", 7)
    target_s = 0.05 if quick else 0.15
    seed = load_seed()
    rows = []
    pools = Pools()
    try:
        t = perf()
        rows += bench_alloc(seed, pools, trials, target_s)
        log(f"items 1-2 in {perf() - t:.1f} s")
        t = perf()
        rows += bench_prefix(seed, pools, trials, 10 if quick else 50)
        log(f"item 3 in {perf() - t:.1f} s")
        pools.close()
        t = perf()
        rows += bench_create(seed, 2 if quick else 3)
        log(f"item 4 in {perf() - t:.1f} s")
        t = perf()
        rows += bench_scaling(seed, pools, 3 if quick else 5,
                              0.5 if quick else getattr(args, "scale_seconds", 1.0))
        log(f"item 5 in {perf() - t:.1f} s")
    finally:
        pools.close()
    if seed is None and rows:
        r = rows[0]
        r["note"] = (r["note"] + "; " if r["note"] else "") + \
            "seed columns n/a: vllm_mlx is not installed (pip install --no-deps vllm-mlx==0.6.0)"
    return rows


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        from tools.bench.pool_scale import worker_main
        sys.exit(worker_main(sys.argv[2]))
    if len(sys.argv) >= 2 and sys.argv[1] == "--profile":
        from tools.bench.pool_profile import profile
        profile()
        sys.exit(0)
    from tools.bench.__main__ import main
    sys.exit(main(["--only", "pool"] + sys.argv[1:]))

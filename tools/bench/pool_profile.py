"""``python -m tools.bench.pool --profile``: where shmcache's time goes in items 1-3.

cProfile of items 1 (``allocate_block`` + ``free_block``), 2
(``get_new_blocks(64)`` + ``free_block_batch``) and 3 (``cache_full_blocks``
+ ``get_computed_blocks``), then, without the profiler, the fixed cost of
one locked call broken down into its parts.
"""

from __future__ import annotations

import random

from tools.bench.pool_fixtures import Pools, batch_loop, pair_loop, perf


def profile(n_pair: int = 30000, n_batch: int = 1500, n_prefix: int = 203, top: int = 25) -> None:
    """Prints the profiles (``top`` rows each) and the fixed costs, on pools of its own.

    Args:
        n_pair: item 1 iterations.
        n_batch: item 2 iterations.
        n_prefix: item 3 requests (the first 3 unprofiled, as a warm-up).
        top: rows per cProfile table.
    """
    import cProfile
    import pstats

    from shmcache.manager.views import SharedBlock
    pools = Pools()
    try:
        _, m = pools.create("prof", max_blocks=1000)
        pair_loop(m)(2000)
        batch_loop(m, m.free_block_batch)(100)
        for label, fn, n in (("item 1: allocate_block + free_block", pair_loop(m), n_pair),
                             ("item 2: get_new_blocks(64) + free_block_batch",
                              batch_loop(m, m.free_block_batch), n_batch)):
            pr = cProfile.Profile()
            pr.enable()
            fn(n)
            pr.disable()
            print(f"\n==== cProfile, {label}, {n} iterations (times inflated by the profiler)")
            pstats.Stats(pr).strip_dirs().sort_stats("tottime").print_stats(top)
        # item 3, for the prefix-cache target
        _, m3 = pools.create("prof3", block_size=16, max_blocks=1024)
        rng = random.Random(7)
        seqs = [[rng.randrange(50_000) for _ in range(1024)] for _ in range(n_prefix)]
        pr = cProfile.Profile()
        for i, toks in enumerate(seqs):
            blocks = m3.get_new_blocks(64)
            if i >= 3:
                pr.enable()
            m3.cache_full_blocks(blocks, toks, 0, 64)
            m3.get_computed_blocks(toks)
            if i >= 3:
                pr.disable()
            m3.free_block_batch(blocks)
            m3.reset_prefix_cache()
        print(f"\n==== cProfile, item 3: cache_full_blocks + get_computed_blocks, "
              f"{n_prefix - 3} requests of 64 blocks (times inflated by the profiler)")
        pstats.Stats(pr).strip_dirs().sort_stats("tottime").print_stats(top)
        # fixed costs of one locked call, without the profiler
        p = m.pool
        nat = p.native

        def t(fn, n=200_000):
            t0 = perf()
            for _ in range(n):
                fn()
            return (perf() - t0) / n * 1e6

        def mutex_pair():
            nat.trylock()
            nat.unlock()

        def with_lock():
            with p.lock:
                pass

        def with_lock_sync():
            with p.lock:
                m.internals.ledger.sync()

        b = m.allocate_block()
        bid = b.block_id
        print("\n==== fixed costs (us per call, no profiler)")
        for label, fn in ((f"pool mutex trylock + unlock ({type(nat).__name__})", mutex_pair),
                          ("with pool.lock: pass", with_lock),
                          ("with pool.lock: _sync()", with_lock_sync),
                          ("SharedBlock(mgr, id)", lambda: SharedBlock(m.internals.ledger, bid)),
                          ("b.block_id (property)", lambda: b.block_id),
                          ("_bid(block)", lambda: m.internals.ledger.bid(b)),
                          ("p.now()", p.now),
                          ("allocate_block + free_block", lambda: m.free_block(m.allocate_block().block_id))):
            print(f"  {label:40s} {t(fn, 50_000 if 'allocate' in label else 200_000):8.3f}")
        m.free_block(bid)
    finally:
        pools.close()

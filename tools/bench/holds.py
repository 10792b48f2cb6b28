"""Holds of the pool lock per call of each of the seed's per-block calls:
``python -m tools.bench.holds``.

One process, one pool (block size 16, a 32-block system prompt published);
each call is made ``--calls`` times with every hold traced
(``_hot.log_holds(2)``, ``PoolLock.trace``: tools/bench/lock_trace.py), and the
table gives per call the holds, the microseconds the lock was held, and the
call's own wall time. A consumer written against vllm-mlx's ``paged_cache``
makes these calls once per block; at N processes the lock's held share,
``N x held / wall`` summed over a request's calls, bounds how far it scales
(docs/design.md, "Where it scales and where it does not yet").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

BS, SYSTEM_BLOCKS = 16, 32


def measure(calls: int) -> list:
    """[(call, holds per call, µs held per call, µs wall per call)]."""
    import shmcache
    mgr = shmcache.create_pool(f"bholds-{os.getpid()}", block_size=BS, max_blocks=65536,
                               max_tables=max(64, calls + 8), max_refs=8 * 65536)
    rows = []
    try:
        nat = mgr.pool.native
        if not hasattr(nat, "take_trace"):
            raise SystemExit("tools.bench.holds: needs the C accelerator (not SHMCACHE_PURE)")
        nat.log_holds(2)
        mgr.pool.lock.trace = True
        sysp = list(range(SYSTEM_BLOCKS * BS))
        t = mgr.create_block_table("system")
        mgr.prepare_append(t, len(sysp))
        mgr.cache_full_blocks(t.block_ids, sysp, 0, SYSTEM_BLOCKS)
        sys_ids = t.block_ids

        def run(name, fn):
            nat.take_trace()
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            wall = (time.perf_counter() - t0) / calls * 1e6
            tr = np.asarray(nat.take_trace(), dtype=np.int64).reshape(-1, 5)
            rows.append((name, len(tr) / calls, (tr[:, 3] - tr[:, 2]).sum() / 1e3 / calls, wall))

        tabs = []
        run("create_block_table", lambda i: tabs.append(mgr.create_block_table(f"r{i}")))
        tokens = sysp + [7] * BS
        run("get_computed_blocks (32 found)", lambda i: mgr.get_computed_blocks(tokens))
        found, _ = mgr.get_computed_blocks(tokens)
        run("add_block_to_table", lambda i: mgr.add_block_to_table(tabs[0], found[i % 32], BS))
        run("find_cached_block (1 block)", lambda i: mgr.find_cached_block(sysp[:BS]))
        run("find_cached_block (32 blocks)", lambda i: mgr.find_cached_block(sysp))
        run("increment_ref", lambda i: mgr.increment_ref(sys_ids[i % 32]))
        run("free_block", lambda i: mgr.free_block(sys_ids[i % 32]))
        fresh = [b.block_id for b in mgr.get_new_blocks(calls)]
        run("register_block_hash (a whole prefix)",
            lambda i: mgr.register_block_hash(fresh[i], sysp + [i] * BS))
        run("delete_block_table", lambda i: mgr.delete_block_table(f"r{i}"))
    finally:
        mgr.destroy()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.holds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls of each kind (default 2000)")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls: must be at least 1")
    print("| call | holds / call | µs held / call | µs wall / call |\n|---|---|---|---|")
    for name, holds, held, wall in measure(args.calls):
        print(f"| {name} | {holds:.2f} | {held:.2f} | {wall:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

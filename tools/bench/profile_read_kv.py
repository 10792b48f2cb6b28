"""What one read_kv call costs at the sizes the engine reads, next to np.copyto.

    python -m tools.bench.profile_read_kv [--shape llama8b|demo] [--blocks 16 128 512] [--cold]

One read is one layer of one sequence's prefix (``mlx_lm.load_prefix``).
``llama8b``: a Llama-3-8B layer (8 KV heads of 128, float16); ``demo``: the
demo model's (4 KV heads of 32, float32); 16-token blocks either way. For
each size: ``read_kv`` evaluated, by the native path where it is built and by
the numpy path, and np.copyto of the same bytes into a kept buffer. With
``--cold``, 64 MiB are written elsewhere before each call (not timed), so that
the arena comes from memory, as it does between other layers' work. Medians
of ``--reps`` calls, microseconds; each row is timed in ``--rounds`` rounds,
interleaved, and printed as the median and the range of the rounds' medians.
Leaves nothing in /dev/shm.

(Only public API and ``kv._native`` are used, so that the same file also
times an older tree: copy it there and run it the same way.)
"""

from __future__ import annotations

import argparse
import time

import shmcache               # first: it picks MLX's BLAS before mlx is imported
import mlx.core as mx
import numpy as np

from shmcache.manager import kv as kvmod

SHAPES = {"llama8b": (8, 128, "float16"), "demo": (4, 32, "float32")}   # (H, D, dtype)
BLOCK = 16


def _median_us(fn, reps: int, flush) -> float:
    fn()
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush += 1           # reads and writes every line: evicts the arena from the caches
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def profile(n: int, shape: str = "llama8b", reps: int = 51, rounds: int = 3,
            cold: bool = False) -> dict:
    """{row: (median, lowest, highest) of the rounds' medians, us} for an n-block read."""
    H, D, dtype = SHAPES[shape]
    mgr = shmcache.PagedCacheManager(max_blocks=max(2048, 4 * n), block_size=BLOCK,
                                     num_layers=1, num_kv_heads=H, head_dim=D, dtype=dtype)
    try:
        arena = mgr.pool.arena
        arena.view(np.uint8)[...] = np.random.default_rng(0).integers(
            0, 255, arena.nbytes, dtype=np.uint8).reshape(arena.view(np.uint8).shape)
        ids = np.random.default_rng(1).permutation(np.arange(1, arena.shape[1]))[:n].tolist()
        nbytes = 2 * arena[0, ids[:1], 0].nbytes * n
        src, kept = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        flush = np.zeros(64 << 20, np.uint8)[::64] if cold else None
        native = getattr(kvmod, "_native", None)

        def numpy_path():
            kvmod._native = None
            try:
                mx.eval(*mgr.read_kv(ids, 0))
            finally:
                kvmod._native = native
        rows = {"read_kv + eval": lambda: mx.eval(*mgr.read_kv(ids, 0))}
        if native is not None:
            rows["numpy path: read_kv + eval"] = numpy_path
        rows["np.copyto, same bytes"] = lambda: np.copyto(kept, src)
        got = {k: [] for k in rows}
        for _ in range(rounds):
            for k, fn in rows.items():
                got[k].append(_median_us(fn, reps, flush))
        return {k: (float(np.median(v)), min(v), max(v)) for k, v in got.items()}
    finally:
        mgr.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--reps", type=int, default=51)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true")
    a = ap.parse_args(argv)
    H, D, dtype = SHAPES[a.shape]
    print(f"{a.shape}: H={H} T={BLOCK} D={D} {dtype}; native read: "
          f"{'yes' if getattr(kvmod, '_native', None) is not None else 'no'}; "
          f"{'cold' if a.cold else 'warm'}")
    for n in a.blocks:
        mib = 2 * n * H * BLOCK * D * np.dtype(dtype).itemsize / (1 << 20)
        print(f"{n} blocks ({mib:.2f} MiB of K and V):")
        for k, (med, lo, hi) in profile(n, a.shape, a.reps, a.rounds, a.cold).items():
            print(f"  {k:30s} {med:9.1f} us  ({lo:.1f}-{hi:.1f})")


if __name__ == "__main__":
    main()

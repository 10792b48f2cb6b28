"""Where a read_kv call spends its time, piece by piece, next to np.copyto.

    python -m tools.profile_read_kv [--blocks 64 512] [--dtype float16 float32]

For each size: the read evaluated, its pieces (id conversion, the new MLX
buffer, page placement, the gather alone, the typed views), the raw C gather
from the shared arena and from a private numpy copy of it (the difference is
what the arena's 4 KiB pages cost), and np.copyto of the same bytes into a
kept buffer. Medians of 301 calls, microseconds. Leaves nothing in /dev/shm.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

import shmcache
from shmcache import kv as kvmod
from shmcache import mxbuf
from tools.bench_workers import _best


def _median_us(fn, reps: int = 301) -> float:
    return _best(fn, reps) * 1e6


def profile(n: int, dtype: str, heads: int = 4, block_size: int = 32, head_dim: int = 32) -> dict:
    mgr = shmcache.PagedCacheManager(max_blocks=2048, block_size=block_size, num_layers=1,
                                     num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    try:
        p = mgr._p
        p.arena[...] = 1
        ids_l = np.random.default_rng(0).permutation(np.arange(1, 2048))[:n].tolist()
        ids = np.asarray(ids_l, dtype=np.int64)
        srcs = (p.arena[0, 0], p.arena[0, 1])
        nbytes = srcs[0][:, :1].nbytes * n
        total = 2 * nbytes + 2 * kvmod._PAGE
        out = {"read_kv + eval": _median_us(lambda: mx.eval(*mgr.read_kv(ids_l, 0))),
               "ids to int64": _median_us(lambda: np.asarray(ids_l, dtype=np.int64))}
        if mxbuf.native is not None:
            base, addr = mxbuf.native.empty(total)
            offs = kvmod._place(addr, srcs, nbytes)
            buf = np.array(base, copy=False)
            dt = mx.bfloat16 if dtype == "bfloat16" else kvmod._MX[dtype]
            out["native empty"] = _median_us(lambda: mxbuf.native.empty(total))
            out["page placement"] = _median_us(lambda: kvmod._place(addr, srcs, nbytes))
            out["gather (with offsets)"] = _median_us(
                lambda: kvmod._gather_into(p, buf, srcs, ids, offs, 1))
            out["native views"] = _median_us(
                lambda: mxbuf.native.views(base, [heads, n * block_size, head_dim], dt, list(offs)))
        if kvmod._gather is not None:
            chunk = srcs[0].strides[1]
            so = np.array([s[h].ctypes.data - p.arena.ctypes.data for s in srcs for h in range(heads)],
                          dtype=np.int64)
            do = np.arange(2 * heads, dtype=np.int64) * n * chunk
            dst = np.empty(2 * nbytes, np.uint8)
            private = p.arena.copy()
            out["raw gather, shared arena"] = _median_us(
                lambda: kvmod._gather(dst, p.arena, ids, so, do, chunk, 1))
            out["raw gather, private copy"] = _median_us(
                lambda: kvmod._gather(dst, private, ids, so, do, chunk, 1))
        src, kept = np.ones(2 * nbytes, np.uint8), np.empty(2 * nbytes, np.uint8)
        out["np.copyto, same bytes"] = _median_us(lambda: np.copyto(kept, src))
        return out
    finally:
        mgr.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--dtype", nargs="+", default=["float16", "float32"],
                    choices=["float16", "bfloat16", "float32"])
    a = ap.parse_args(argv)
    print(f"native arrays: {'yes' if mxbuf.native is not None else 'no'}; "
          f"C gather: {'yes' if kvmod._gather is not None else 'no'}")
    for dtype in a.dtype:
        for n in a.blocks:
            print(f"{n} blocks, {dtype}:")
            for k, v in profile(n, dtype).items():
                print(f"  {k:28s} {v:9.1f} us")


if __name__ == "__main__":
    main()

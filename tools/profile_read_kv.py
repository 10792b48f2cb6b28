"""Where a read_kv call spends its time, piece by piece, next to np.copyto.

    python -m tools.profile_read_kv [--blocks 64 512] [--dtype float16 float32]

For each size: the read evaluated and not; where the native module is built,
its one call (``read_layer``) alone, with one thread and with two, each at
read_kv's thresholds for non-temporal stores (see kv._shared_stream_bytes)
and with its stores all non-temporal and all not; the fallback's pieces
(the id check and the staged read); the raw C gather from the shared arena
and from a private numpy copy of it (the difference is what shared memory
costs), each into a buffer at the source's page offset; and np.copyto of the
same bytes into a kept buffer. Medians of 301 calls,
microseconds. Leaves nothing in /dev/shm.
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
        srcs = (p.arena[0, :, 0], p.arena[0, :, 1])    # (max_blocks, H, T, D) each
        nbytes = srcs[0][:1].nbytes * n
        out = {"read_kv + eval": _median_us(lambda: mx.eval(*mgr.read_kv(ids_l, 0))),
               "read_kv": _median_us(lambda: mgr.read_kv(ids_l, 0)),
               "fallback: id check": _median_us(lambda: mgr._bids(ids_l))}
        if mxbuf.native is not None:
            dt = kvmod._DT[dtype]
            for t in (1, 2):
                name = f"native read_layer, {t} thread{'s' * (t > 1)}"
                for what, alone, shared in (("", kvmod._STAGED_BYTES, kvmod._SHARED_STREAM_BYTES),
                                            (", streamed", 0, 0),
                                            (", not streamed", 1 << 62, 1 << 62)):
                    out[name + what] = _median_us(lambda: mx.eval(*mxbuf.native.read_layer(
                        p.arena, ids_l, 0, dt, t, 0, alone, shared)))
        native, mxbuf.native = mxbuf.native, None
        try:
            out["fallback: read + eval"] = _median_us(lambda: mx.eval(*kvmod.read(p, ids_l, 0)))
        finally:
            mxbuf.native = native
        if kvmod._gather is not None:
            chunk, stride = srcs[0].strides[1], srcs[0].strides[0]
            so = np.array([s.ctypes.data - p.arena.ctypes.data + h * chunk
                           for s in srcs for h in range(heads)], dtype=np.int64)
            raw = np.empty(2 * nbytes + kvmod._PAGE, np.uint8)
            at = (srcs[0].ctypes.data - raw.ctypes.data) % kvmod._PAGE
            dst = raw[at:at + 2 * nbytes]          # at the source's page offset (see kv._place)
            do = np.arange(2 * heads, dtype=np.int64) * n * chunk
            private = p.arena.copy()
            out["raw gather, shared arena"] = _median_us(
                lambda: kvmod._gather(dst, p.arena, ids, so, do, chunk, 1, stride))
            out["raw gather, private copy"] = _median_us(
                lambda: kvmod._gather(dst, private, ids, so, do, chunk, 1, stride))
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
    print(f"native read: {'yes' if mxbuf.native is not None else 'no'}; "
          f"C gather: {'yes' if kvmod._gather is not None else 'no'}")
    for dtype in a.dtype:
        for n in a.blocks:
            print(f"{n} blocks, {dtype}:")
            for k, v in profile(n, dtype).items():
                print(f"  {k:40s} {v:9.1f} us")


if __name__ == "__main__":
    main()

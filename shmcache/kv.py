"""KV payload reads and writes between the shared arena and MLX arrays.

The arena is shaped (L, 2, H, max_blocks, T, D) (see ``layout``). A read
gathers the requested blocks of one layer straight into the memory of a new
MLX array: MLX cannot import CPU memory without a copy, so we allocate the
MLX array first and let numpy ``take`` write into a zero-copy view of it.
That one gather is the only copy. Writes go the other way: a zero-copy
numpy view of the (evaluated) MLX array is assigned into the arena.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_MX = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.uint16}


def _np_view(a: mx.array) -> np.ndarray:
    return np.array(a, copy=False)


def check_layer(p, layer) -> None:
    L = p.layout.num_layers
    if p.arena is None:
        raise ValueError(f"pool {p.name!r} has no KV arena (num_layers=0)")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"layer must be an int in [0, {L}), got {layer!r}")


def as_storage(p, x) -> np.ndarray:
    """An MLX (or numpy) array as a numpy view in the arena's storage dtype."""
    lay = p.layout
    if isinstance(x, mx.array):
        if lay.dtype == "bfloat16":
            x = x.astype(mx.bfloat16).view(mx.uint16)
        else:
            x = x.astype(_MX[lay.dtype])
        mx.eval(x)
        return _np_view(x)
    arr = np.asarray(x)
    if lay.dtype == "bfloat16":
        if arr.dtype != np.uint16:
            raise TypeError("a bfloat16 pool takes MLX arrays (or raw uint16 words)")
        return arr
    return arr.astype(p.arena.dtype, copy=False)


def write(p, block_id: int, layer: int, keys, values, start: int = 0) -> None:
    lay = p.layout
    k, v = as_storage(p, keys), as_storage(p, values)
    want = (lay.num_kv_heads, lay.head_dim)
    for name, a in (("keys", k), ("values", v)):
        if a.ndim != 3 or (a.shape[0], a.shape[2]) != want:
            raise ValueError(f"{name} must have shape ({want[0]}, T, {want[1]}) "
                             f"(num_kv_heads, tokens, head_dim), got {a.shape}")
    if k.shape != v.shape:
        raise ValueError(f"keys {k.shape} and values {v.shape} differ in shape")
    t = k.shape[1]
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + t > lay.block_size:
        raise ValueError(f"start={start!r} with {t} tokens does not fit a block of {lay.block_size}")
    p.arena[layer, 0, :, block_id, start:start + t, :] = k
    p.arena[layer, 1, :, block_id, start:start + t, :] = v


_PAGE = 4096


def read(p, block_ids, layer: int):
    lay = p.layout
    ids = np.asarray(block_ids, dtype=np.int64)
    H, n, T, D = lay.num_kv_heads, ids.size, lay.block_size, lay.head_dim
    nbytes = H * n * T * D * p.arena.itemsize
    srcs = (p.arena[layer, 0], p.arena[layer, 1])
    # MLX has no uninitialised arrays, so the gather lands in a zeroed one:
    # one byte buffer for K and V, zeroed as bytes (a plain memset, about
    # twice as fast as a typed fill), then viewed in the final dtype.
    raw = mx.zeros((2 * nbytes + 2 * _PAGE,), dtype=mx.uint8)
    mx.eval(raw)
    buf = _np_view(raw)
    # NOTE: each (head, block) chunk of the arena starts on a page, and a
    # large MLX buffer a few bytes past one; with the destination a few bytes
    # off the source's page offset, the chunk copies ran about 5x slower
    # (4K aliasing). So K and V are placed at their sources' page offsets,
    # using the page of slack allocated for each.
    base = buf.ctypes.data
    ok = (srcs[0].ctypes.data - base) % _PAGE
    ov = ok + nbytes + (srcs[1].ctypes.data - (base + ok + nbytes)) % _PAGE
    for s, o in zip(srcs, (ok, ov)):
        # NOTE: mode="clip" (ids are validated by the caller): with the
        # default mode="raise" numpy buffers ``out`` and copies twice.
        np.take(s, ids, axis=1, out=buf[o:o + nbytes].view(s.dtype).reshape(H, n, T, D),
                mode="clip")
    dt = mx.bfloat16 if lay.dtype == "bfloat16" else _MX[lay.dtype]
    # Views of the one buffer (MLX copies nothing); holding either keeps both.
    k, v = (raw[o:o + nbytes].view(dt).reshape(H, n * T, D) for o in (ok, ov))
    mx.eval(k, v)
    return k, v


def copy_block(p, src: int, dst: int) -> None:
    if p.arena is not None:
        p.arena[:, :, :, dst] = p.arena[:, :, :, src]

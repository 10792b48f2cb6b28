"""The KV arena: payload writes and reads between MLX arrays and the shared arena.

The arena is shaped (L, max_blocks, 2, H, T, D) (see ``layout``). A write
assigns a zero-copy numpy view of the (evaluated) MLX array into it. A read
of one layer of n blocks gives K and V, each (H, n*T, D), in one of two ways:

- native (``shmcache._mlxbuf``, C++, where it was built against this very
  MLX version and passes a self-check): the blocks are copied straight into
  a new MLX buffer, in one call, one copy;
- numpy, everywhere else (or with ``SHMCACHE_PURE`` set): the blocks are
  copied into a numpy buffer, then ``mx.array`` copies that into MLX.

Both give the same bytes (tests/test_kv.py compares them).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from ..shm.layout import KV_DTYPES

# layout.KV_DTYPES as MLX dtypes: as stored (bfloat16 as its raw uint16 bits) and as read
_MX = {n: getattr(mx, d.np_dtype.name) for n, d in KV_DTYPES.items()}
_DT = {n: getattr(mx, n) for n in KV_DTYPES}


def _load_native():
    if os.environ.get("SHMCACHE_PURE"):
        return None
    try:
        from shmcache import _mlxbuf
    except ImportError:
        return None
    # NOTE: the module uses MLX's backend API, whose layout may change between
    # versions: only the exact version it was compiled against is trusted,
    # and only if a round trip gives back what was written (a module left
    # from an older build, with other arguments, fails it too).
    if getattr(_mlxbuf, "MLX_VERSION", None) != mx.__version__:
        return None
    try:
        arena = np.arange(24, dtype=np.float32).reshape(1, 3, 2, 1, 2, 2)   # (L, M, 2, H, T, D)
        k, v = _mlxbuf.read_layer(arena, [2, 0], 0, mx.float32)
        want = arena[0, [2, 0]].transpose(1, 2, 0, 3, 4).reshape(2, 1, 4, 2)  # (2, H, n*T, D)
        ok = (isinstance(k, mx.array) and k.dtype == mx.float32 and k.shape == (1, 4, 2)
              and np.array_equal(np.array(k), want[0]) and np.array_equal(np.array(v), want[1]))
    except Exception:
        return None
    return _mlxbuf if ok else None


_native = _load_native()


def check_layer(p, layer) -> None:
    """Raises ValueError unless ``p`` has a KV arena and ``layer`` is an int
    in [0, num_layers)."""
    L = p.layout.num_layers
    if p.arena is None:
        raise ValueError(f"pool {p.name!r} has no KV arena (num_layers=0)")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"layer must be an int in [0, {L}), got {layer!r}")


def as_storage(p, x, name: str = "keys") -> np.ndarray:
    """An MLX (or numpy) array as a numpy view in the arena's storage dtype.

    Raises:
        TypeError: not a floating-point array (integers, booleans and complex
            numbers are refused, not cast); raw uint16 words are taken only
            by a bfloat16 pool, as its stored form.
    """
    lay = p.layout
    if isinstance(x, mx.array):
        if not mx.issubdtype(x.dtype, mx.floating):
            raise TypeError(f"{name} must be a floating-point array (the pool stores "
                            f"{lay.dtype}), got {x.dtype}")
        if lay.dtype == "bfloat16":
            x = x.astype(mx.bfloat16).view(mx.uint16)
        else:
            x = x.astype(_MX[lay.dtype])
        mx.eval(x)
        return np.array(x, copy=False)
    arr = np.asarray(x)
    if lay.dtype == "bfloat16":
        if arr.dtype != np.uint16:
            raise TypeError(f"{name}: a bfloat16 pool takes MLX arrays (or raw uint16 words), "
                            f"got {arr.dtype}")
        return arr
    if arr.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array (the pool stores "
                        f"{lay.dtype}), got {arr.dtype}")
    return arr.astype(p.arena.dtype, copy=False)


def write(p, block_id: int, layer: int, keys, values, start: int = 0) -> None:
    """Write tokens ``start:start+t`` of one block's K and V in one layer.

    The caller has checked the block (held, not the null block) and the layer.

    Args:
        p: the pool.
        block_id: the block.
        layer: the layer.
        keys, values: ``# (H, t, D)`` each, floating point (see ``as_storage``).
        start: the first token slot written.

    Raises:
        TypeError: see ``as_storage``.
        ValueError: a shape other than ``(H, t, D)``, keys and values of
            different shapes, or tokens that do not fit the block.
    """
    lay = p.layout
    k, v = as_storage(p, keys, "keys"), as_storage(p, values, "values")
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
    p.arena[layer, block_id, 0, :, start:start + t, :] = k
    p.arena[layer, block_id, 1, :, start:start + t, :] = v


def read_fast(p, block_ids, layer: int):
    """The native read of unchecked ids, or None where it does not apply.

    None (nothing done) without the native module, when ``block_ids`` is not
    a list or tuple of plain ints in [0, max_blocks), or when the result would
    not fit 2 GiB; the caller then checks the ids and calls ``read``. The
    caller has checked ``layer`` and that the pool is usable.

    Returns:
        ``(keys, values)``, each ``# (H, n*T, D)`` in the pool's dtype, or None.
    """
    if _native is None:
        return None
    return _native.read_layer(p.arena, block_ids, layer, _DT[p.layout.dtype])


def read(p, block_ids, layer: int):
    """K and V of blocks ``block_ids`` in one layer, in that order.

    The native read where it applies, else numpy. The caller has checked the
    ids (plain ints in range), ``layer`` and that the pool is usable.

    Args:
        p: the pool.
        block_ids: a list of block ids (ints), repeats allowed.
        layer: the layer.

    Returns:
        ``(keys, values)``, new MLX arrays (copies), each ``# (H, n*T, D)``
        in the pool's dtype (bfloat16 pools: bfloat16, stored as uint16).
    """
    out = read_fast(p, block_ids, layer)
    if out is not None:
        return out
    lay = p.layout
    H, n, T, D = lay.num_kv_heads, len(block_ids), lay.block_size, lay.head_dim
    buf = np.empty((2, H, n, T, D), dtype=p.arena.dtype)        # (K|V, H, n, T, D)
    slots = buf.transpose(2, 0, 1, 3, 4)                         # (n, K|V, H, T, D)
    src = p.arena[layer]                                         # (max_blocks, 2, H, T, D)
    # NOTE: a loop over blocks: np.take into the transposed buffer took 2x
    # as long at 128 blocks, and 50x from a K or V view of the arena (numpy
    # copied the whole layer to make it contiguous first).
    for i, b in enumerate(block_ids):
        slots[i] = src[b]
    k, v = (mx.array(buf[kv].reshape(H, n * T, D)) for kv in (0, 1))
    if lay.dtype == "bfloat16":
        return k.view(mx.bfloat16), v.view(mx.bfloat16)
    return k, v


def copy_block(p, src: int, dst: int) -> None:
    """Copy block ``src``'s K and V, every layer, onto block ``dst``."""
    if p.arena is not None:
        p.arena[:, dst] = p.arena[:, src]

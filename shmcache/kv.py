"""KV payload reads and writes between the shared arena and MLX arrays.

The arena is shaped (L, max_blocks, 2, H, T, D) (see ``layout``). A read
gathers the requested blocks of one layer straight into the memory of a new
MLX array: MLX cannot import CPU memory without a copy, so we allocate the
MLX array first and gather into a zero-copy view of it, with the C gather
(``shmcache._gather``) where it is built and numpy ``take`` where not. That
one gather is the only copy. Writes go the other way: a zero-copy numpy view
of the (evaluated) MLX array is assigned into the arena.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from shmcache import mxbuf

try:
    if os.environ.get("SHMCACHE_PURE"):
        raise ImportError("SHMCACHE_PURE is set")
    from shmcache._gather import gather as _gather
except ImportError:
    _gather = None


def _gather_threads() -> int:
    env = os.environ.get("SHMCACHE_GATHER_THREADS")
    if env is not None:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"SHMCACHE_GATHER_THREADS must be a positive int, got {env!r}")
        return int(env)
    # NOTE: two at most, and reads use the second only past _STAGED_BYTES.
    # The helper is kept between calls and spins 0.3 ms after each job (see
    # _gather_pool.h): a 512-block fp16 read took 272 us with it against 476
    # on one thread, a 64-block one 33 against 38 (``python -m
    # tools.profile_read_kv``). Small reads stay on one thread because the
    # workers make them every decode step, and a helper spinning after each
    # would take a vCPU from the other workers for the little it saves.
    return min(2, len(os.sched_getaffinity(0)))


_THREADS = _gather_threads()

_MX = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.uint16}   # storage
_DT = {**_MX, "bfloat16": mx.bfloat16}                                          # as read


def _np_view(a: mx.array) -> np.ndarray:
    return np.array(a, copy=False)


def check_layer(p, layer) -> None:
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
        return _np_view(x)
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


_PAGE = 4096
# Reads up to this many bytes (K and V) are staged: gathered into numpy memory
# and copied into MLX by the array constructor, in this thread. Larger reads
# are gathered straight into a new MLX buffer (``mxbuf.filled``), which
# takes an evaluation.
# NOTE: an evaluation hands work to MLX's stream thread and waits for it:
# 50-150 us on the development VM when that thread has gone idle, about what
# copying 2-4 MiB costs, so below that the second copy is the cheaper one.
_STAGED_BYTES = 4 << 20


def _l3_bytes(base: str = "/sys/devices/system/cpu/cpu0/cache"):
    try:
        entries = sorted(e for e in os.listdir(base) if e.startswith("index"))
    except OSError:
        return None
    for idx in entries:
        try:
            with open(f"{base}/{idx}/level") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{base}/{idx}/size") as f:
                size = f.read().strip()
            unit = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * unit
        except (OSError, ValueError):
            continue
    return None


def _shared_stream_bytes(l3) -> int:
    # NOTE: what a read copies while a helper thread shares it (see
    # _gather_pool.h) uses non-temporal stores past this many bytes (K and
    # V): 3/8 of the L3, i.e. past where the source and the result together
    # no longer fit in 3/4 of it. Below that, ordinary stores leave the result
    # in cache for the attention that reads it next, and with two threads
    # were faster: in 4 interleaved rounds, 8 MiB reads went from 0.77-1.07x
    # of np.copyto streamed to 1.32-1.83x not, while 16 MiB ones were faster
    # streamed (1.63-1.78x against 1.06-1.35x), with a 32 MiB L3. One thread
    # alone is the other way round (8 MiB: 0.85-0.91x streamed, 0.32-0.69x
    # not: one core's line-fill buffers are the limit, and ordinary stores
    # also read each line first), so what the caller copies before a helper
    # joins keeps _STAGED_BYTES (4 MiB). ``python -m tools.profile_read_kv
    # --blocks 512`` shows both. Without /sys (not Linux) 4 MiB; sysconf's
    # L3 figure is not used because on this VM it says 320 MiB.
    return max(_STAGED_BYTES, 3 * l3 // 8) if l3 else _STAGED_BYTES


_SHARED_STREAM_BYTES = _shared_stream_bytes(_l3_bytes())


def _place(base: int, srcs, nbytes: int):
    # NOTE: each block's run in the arena starts on a page, and a large
    # buffer a few bytes past one; with the destination a few bytes off
    # the source's page offset, the chunk copies ran about 5x slower (4K
    # aliasing). So K and V are placed at their sources' page offsets, using
    # the page of slack allocated for each.
    ok = (srcs[0].ctypes.data - base) % _PAGE
    return ok, ok + nbytes + (srcs[1].ctypes.data - (base + ok + nbytes)) % _PAGE


def _gather_into(p, buf, srcs, ids, offs, threads: int) -> None:
    H, n = p.layout.num_kv_heads, ids.size
    # srcs: one layer's K and V, each (max_blocks, H, T, D), block stride 2*H chunks
    chunk, stride = srcs[0].strides[1], srcs[0].strides[0]
    if _gather is not None:
        hs = np.arange(H, dtype=np.int64)
        src_offs = (np.array([s.ctypes.data for s in srcs], dtype=np.int64)
                    - p.arena.ctypes.data)[:, None] + hs * chunk
        dst_offs = np.array(offs, dtype=np.int64)[:, None] + hs * (n * chunk)
        _gather(buf, p.arena, ids, src_offs.ravel(), dst_offs.ravel(), chunk, threads, stride,
                _STAGED_BYTES, _SHARED_STREAM_BYTES)
        return
    nbytes = H * n * chunk
    for s, o in zip(srcs, offs):
        out = buf[o:o + nbytes].view(s.dtype).reshape(H, n, *s.shape[2:]).transpose(1, 0, 2, 3)
        # NOTE: mode="clip" (ids are validated by the caller): with the
        # default mode="raise" numpy buffers ``out`` and copies twice.
        np.take(s, ids, axis=0, out=out, mode="clip")


def read_fast(p, block_ids, layer: int):
    """K and V in one native call, or None where that call does not apply.

    None (nothing done) without the native module, when ``block_ids`` is not
    a list or tuple of plain ints in range, or when the result would not fit
    2 GiB; ``read`` (after the caller has checked the ids) then does it.
    The caller has checked ``layer`` and that the pool is usable.
    """
    nat = mxbuf.native
    if nat is None:
        return None
    return nat.read_layer(p.arena, block_ids, layer, _DT[p.layout.dtype], _THREADS, _STAGED_BYTES,
                          _STAGED_BYTES, _SHARED_STREAM_BYTES)


def read(p, block_ids, layer: int):
    out = read_fast(p, block_ids, layer)
    if out is not None:
        return out
    lay = p.layout
    ids = np.asarray(block_ids, dtype=np.int64)
    H, n, T, D = lay.num_kv_heads, ids.size, lay.block_size, lay.head_dim
    nbytes = H * n * T * D * p.arena.itemsize
    srcs = (p.arena[layer, :, 0], p.arena[layer, :, 1])
    dt = _DT[lay.dtype]
    total = 2 * nbytes + 2 * _PAGE
    if 2 * nbytes <= _STAGED_BYTES:
        buf = np.empty(total, dtype=np.uint8)
        offs = _place(buf.ctypes.data, srcs, nbytes)
        _gather_into(p, buf, srcs, ids, offs, 1)
        k, v = (mx.array(buf[o:o + nbytes].view(p.arena.dtype).reshape(H, n * T, D))
                for o in offs)
        return (k.view(dt), v.view(dt)) if lay.dtype == "bfloat16" else (k, v)
    box = []

    def fill(buf):
        box.append(_place(buf.ctypes.data, srcs, nbytes))
        _gather_into(p, buf, srcs, ids, box[-1], _THREADS)
    raw = mxbuf.filled(total, fill)
    # Views of the one buffer (MLX copies nothing); holding either keeps both.
    # They are left unevaluated: whoever uses them evaluates them for free
    # with the rest of their graph, which saves a second hand-off.
    return tuple(raw[o:o + nbytes].view(dt).reshape(H, n * T, D) for o in box[-1])


def copy_block(p, src: int, dst: int) -> None:
    if p.arena is not None:
        p.arena[:, dst] = p.arena[:, src]

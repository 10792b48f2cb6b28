"""shmcache._mlxbuf.read_layer: the native KV read, straight into new MLX arrays.

Skipped where the module is not usable (not built, another MLX version, or
SHMCACHE_PURE set); tests/test_kv.py then covers the numpy read alone.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcache.manager import kv

from _helpers import layer_kv

native = kv._native
pytestmark = pytest.mark.skipif(native is None, reason="shmcache._mlxbuf is not usable here")

STORAGE = {"float16": (np.float16, mx.float16), "float32": (np.float32, mx.float32),
           "bfloat16": (np.uint16, mx.bfloat16)}


def arena_of(shape=(3, 10, 2, 3, 4, 8), dtype="float16", seed=0, skew=0):
    """A random C-contiguous arena whose first byte is `skew` bytes past a page."""
    np_dt = STORAGE[dtype][0]
    n = int(np.prod(shape)) * np.dtype(np_dt).itemsize
    raw = np.empty(n + 2 * 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096 + skew
    a = raw[start:start + n].view(np_dt).reshape(shape)
    a[...] = np.random.default_rng(seed).integers(0, 1 << 14, shape).astype(np_dt)
    return a


def raw_of(x: mx.array) -> np.ndarray:
    return np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x, copy=False)


def test_refused_for_another_mlx_version(monkeypatch):
    assert kv._load_native() is native
    monkeypatch.setattr(native, "MLX_VERSION", "0.0.1")
    assert kv._load_native() is None
    monkeypatch.undo()
    monkeypatch.setenv("SHMCACHE_PURE", "1")
    assert kv._load_native() is None


@pytest.mark.parametrize("dtype", list(STORAGE))
@pytest.mark.parametrize("layer", [0, 2])
def test_gathers_in_block_order(dtype, layer):
    arena = arena_of(dtype=dtype)
    ids = [9, 2, 2, 0, 7]
    want = layer_kv(arena, ids, layer)
    k, v = native.read_layer(arena, ids, layer, STORAGE[dtype][1])
    for got, w in ((k, want[0]), (v, want[1])):
        assert got.dtype == STORAGE[dtype][1] and got.shape == (3, 5 * 4, 8)
        assert np.array_equal(raw_of(got), w)
    arena[...] = 0                                   # a copy: later writes do not show
    assert np.array_equal(raw_of(k), want[0]) and np.array_equal(raw_of(v), want[1])
    # MLX computes on them like on any array
    if dtype == "float32":
        assert np.allclose(np.array((k[:, 4:] * 2).sum(axis=1)), 2 * want[0][:, 4:].sum(axis=1))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 3), M=st.integers(1, 12), H=st.integers(1, 4), T=st.integers(1, 5),
       D=st.integers(1, 9), dtype=st.sampled_from(list(STORAGE)), data=st.data())
def test_matches_the_reference_for_any_shape(L, M, H, T, D, dtype, data):
    """Odd sizes too (chunks that are no multiple of 16 bytes), any ids with
    repeats, any layer: the same bytes as numpy's fancy indexing."""
    arena = arena_of((L, M, 2, H, T, D), dtype, seed=L * 1000 + M)
    layer = data.draw(st.integers(0, L - 1))
    ids = data.draw(st.lists(st.integers(0, M - 1), max_size=20))
    k, v = native.read_layer(arena, ids, layer, STORAGE[dtype][1])
    want = layer_kv(arena, ids, layer)
    assert k.shape == v.shape == (H, len(ids) * T, D)
    assert raw_of(k).tobytes() == want[0].tobytes() and raw_of(v).tobytes() == want[1].tobytes()


STREAM_FROM = 4 << 20       # copy.h's kStreamFrom: reads of this many bytes or more stream


@pytest.mark.parametrize("dtype", list(STORAGE))
@pytest.mark.parametrize("skew", [0, 6])
@pytest.mark.parametrize("T,D", [(16, 64), (15, 65)])
def test_cached_and_streamed_copies_match_the_numpy_read(monkeypatch, dtype, skew, T, D):
    """Reads on both sides of the size from which the copy streams its
    stores, at the engine's chunks (2 or 4 KiB) and at chunks that are no
    multiple of 32 bytes (so most chunks land off a 32-byte boundary, with a
    head and a tail outside the 128-byte loop), from an arena `skew` bytes
    past a page: the same bytes as kv.py's numpy read."""
    H, M = 4, 40
    arena = arena_of((2, M, 2, H, T, D), dtype, seed=T + skew, skew=skew)
    per_block = 2 * H * T * D * arena.itemsize                  # K and V of one block
    first = -(-STREAM_FROM // per_block)                         # the fewest blocks that stream
    pool = SimpleNamespace(arena=arena, layout=SimpleNamespace(
        dtype=dtype, num_kv_heads=H, block_size=T, head_dim=D))
    rng = np.random.default_rng(skew)
    for n in (first // 4, first - 1, first, 2 * first):
        ids = rng.integers(0, M, n).tolist()
        k, v = native.read_layer(arena, ids, 1, STORAGE[dtype][1])
        with monkeypatch.context() as mp:
            mp.setattr(kv, "_native", None)
            want = kv.read(pool, ids, 1)
        for got, w in zip((k, v), want):
            assert got.shape == (H, n * T, D) and got.dtype == w.dtype
            assert raw_of(got).tobytes() == raw_of(w).tobytes(), (n, n * per_block)


@pytest.mark.parametrize("skew", [0, 64, 2052, 2])
def test_lands_at_the_sources_page_offsets(skew):
    arena = arena_of(shape=(2, 16, 2, 2, 8, 16), dtype="float32", skew=skew)
    ids = [15, 3, 8]
    k, v = native.read_layer(arena, ids, 1, mx.float32)
    for x, which in ((k, 0), (v, 1)):
        gap = (arena[1, 0, which].ctypes.data - raw_of(x).ctypes.data) % 4096
        # where the arena's items are not item-aligned, the nearest whole item before
        assert gap == skew % 4
    want = layer_kv(arena, ids, 1)
    assert np.array_equal(raw_of(k), want[0]) and np.array_equal(raw_of(v), want[1])


def test_keeps_its_buffer_alive():
    arena = arena_of(dtype="float32")
    want = layer_kv(arena, [1, 4], 0)
    k, v = native.read_layer(arena, [1, 4], 0, mx.float32)
    del k
    gc.collect()
    mx.eval(mx.zeros(v.nbytes * 2, dtype=mx.uint8) + 1)  # would likely reuse a freed buffer
    assert np.array_equal(raw_of(v), want[1])


def test_of_no_blocks():
    k, v = native.read_layer(arena_of(), [], 1, mx.float16)
    assert k.shape == v.shape == (3, 0, 8) and k.dtype == mx.float16


@pytest.mark.parametrize("ids", [np.array([1, 2]), iter([1, 2]), [1, np.int64(2)], [1, True],
                                 [1, -1], [10], [1, 1 << 70], [1.0], ["1"], None, 3])
def test_declines_what_it_does_not_take(ids):
    # None: the caller's own path checks such ids (and says what is wrong).
    assert native.read_layer(arena_of(), ids, 0, mx.float16) is None


def test_rejects_a_bad_arena_layer_or_dtype():
    a = arena_of()
    with pytest.raises(ValueError, match="arena must be a C-contiguous"):
        native.read_layer(a[0], [1], 0, mx.float16)
    with pytest.raises(ValueError, match="arena must be a C-contiguous"):
        native.read_layer(np.zeros((1, 4, 3, 1, 2, 2), np.float16), [1], 0, mx.float16)
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        native.read_layer(a[..., ::2], [1], 0, mx.float16)
    for layer in (-1, 3):
        with pytest.raises(ValueError, match=rf"layer {layer} not in \[0, 3\)"):
            native.read_layer(a, [1], layer, mx.float16)
    with pytest.raises(ValueError, match="item size"):
        native.read_layer(a, [1], 0, mx.float32)

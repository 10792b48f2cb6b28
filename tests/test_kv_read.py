"""read_kv's two paths (the native one-copy read, shmcache._mlxbuf, and the
numpy read): the same bytes as written, in block order, for every form of
id list and size; SHMCACHE_PURE turns the native one off."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from shmcache.manager import kv as kvmod

from _helpers import layer_kv
from _kv import D, H, MXDT, T, kv_pool, rand


WAYS = ["native", "numpy"]


def use_way(monkeypatch, way):
    """Force one of read()'s two paths."""
    if way == "native":
        if kvmod._native is None:
            pytest.skip("shmcache._mlxbuf is not usable here")
    else:
        monkeypatch.setattr(kvmod, "_native", None)


def raw_bytes(x: mx.array) -> bytes:
    """The array's bytes as stored (bfloat16 as its uint16 words)."""
    return np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_both_paths_give_the_written_bytes(make_pool, monkeypatch, dtype):
    """The native read and the numpy read agree byte for byte, with each
    other and with what write_kv wrote, in block order (repeats too), as
    (H, n*T, D) arrays of the pool's dtype."""
    if kvmod._native is None:
        pytest.skip("shmcache._mlxbuf is not usable here: only one path to compare")
    m = kv_pool(make_pool, dtype)
    ids = [b.block_id for b in m.get_new_blocks(4)]
    written = {}
    for i, b in enumerate(ids):
        for layer in (0, 1):
            k, v = rand(10 * i + layer, dtype=dtype), rand(100 + 10 * i + layer, dtype=dtype)
            m.write_kv(b, layer, k, v)
            written[b, layer] = (k, v)
    order = [ids[3], ids[0], ids[0], ids[2]]
    native = m.read_kv(order, 1)
    monkeypatch.setattr(kvmod, "_native", None)
    plain = m.read_kv(order, 1)
    for which in (0, 1):
        want = mx.concatenate([written[b, 1][which] for b in order], axis=1)
        for got in (native[which], plain[which]):
            assert got.dtype == MXDT[dtype] and got.shape == (H, len(order) * T, D)
            assert raw_bytes(got) == raw_bytes(want)
        assert raw_bytes(native[which]) == raw_bytes(plain[which])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("way", WAYS)
def test_every_way_of_reading_agrees(make_pool, monkeypatch, dtype, way):
    """Each path gives the arena's bytes, in block order, independent of
    later writes."""
    m = kv_pool(make_pool, dtype, layers=2)
    rng = np.random.default_rng(3)
    m.pool.arena[...] = rng.integers(0, 1 << 14, m.pool.arena.shape).astype(m.pool.arena.dtype)
    use_way(monkeypatch, way)
    ids = [9, 2, 2, 15, 0, 7]
    want = layer_kv(m.pool.arena, ids, 1)
    got = m.read_kv(ids, 1)
    again = m.read_kv(ids, 1)
    m.pool.arena[...] = 0
    for g, w in zip(got + again, want + want):
        assert g.dtype == MXDT[dtype] and g.shape == (H, len(ids) * T, D)
        raw = g.view(mx.uint16) if dtype == "bfloat16" else g
        assert np.array_equal(np.array(raw), w)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("way", WAYS)
def test_large_read_is_exact_and_independent(make_pool, monkeypatch, dtype, way):
    """An engine-sized read (8 MiB of float16 K and V): exact, no aliasing
    between or within reads; the native one lands at its sources' offsets
    within a page (the copy's speed depends on it)."""
    use_way(monkeypatch, way)
    h, d, t = 8, 128, 16
    n = 128
    m = make_pool(block_size=t, max_blocks=n + 40, num_layers=2, num_kv_heads=h,
                  head_dim=d, dtype=dtype)
    rng = np.random.default_rng(0)
    m.pool.arena[...] = rng.integers(0, 1 << 14, m.pool.arena.shape).astype(m.pool.arena.dtype)
    ids = rng.permutation(np.arange(n + 40))[:n].tolist()
    want = layer_kv(m.pool.arena, ids, 1)
    rk, rv = m.read_kv(ids, 1)
    rk2, _ = m.read_kv(ids, 1)

    def np_of(x):
        return np.array(x.view(mx.uint16) if dtype == "bfloat16" else x, copy=False)
    for got, w in ((rk, want[0]), (rv, want[1]), (rk2, want[0])):
        assert got.dtype == MXDT[dtype] and got.shape == (h, n * t, d)
        assert np.array_equal(np_of(got), w)
    ptrs = [np_of(x).ctypes.data for x in (rk, rv, rk2)]
    assert len(set(ptrs)) == 3
    if way == "native":
        for x, kv in ((rk, 0), (rv, 1)):
            assert np_of(x).ctypes.data % 4096 == m.pool.arena[1, 0, kv].ctypes.data % 4096
    m.pool.arena[...] = 0                            # later writes do not show through
    assert np.array_equal(np_of(rk), want[0])


@pytest.mark.parametrize("way", WAYS)
def test_empty_read(make_pool, monkeypatch, way):
    use_way(monkeypatch, way)
    m = kv_pool(make_pool, "float32")
    k, v = m.read_kv([], 0)
    assert k.shape == v.shape == (H, 0, D) and k.dtype == mx.float32


def test_pure_env_disables_the_native_read(monkeypatch):
    monkeypatch.setenv("SHMCACHE_PURE", "1")
    assert kvmod._load_native() is None

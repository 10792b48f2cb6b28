"""KV payload: write_kv / read_kv between MLX arrays and the shared arena."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import shmcache

from _kv import D, H, MXDT, T, as_np, kv_pool, rand


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_roundtrip_each_dtype(make_pool, dtype):
    m = kv_pool(make_pool, dtype)
    b = m.allocate_block()
    k, v = rand(1, dtype=dtype), rand(2, dtype=dtype)
    m.write_kv(b.block_id, 0, k, v)
    rk, rv = m.read_kv([b.block_id], 0)
    assert isinstance(rk, mx.array) and isinstance(rv, mx.array)
    assert rk.dtype == MXDT[dtype] and rv.dtype == MXDT[dtype]
    assert rk.shape == (H, T, D) and rv.shape == (H, T, D)
    assert np.array_equal(as_np(rk), as_np(k))      # exact: same dtype both ways
    assert np.array_equal(as_np(rv), as_np(v))
    assert not np.array_equal(as_np(rk), as_np(rv))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_write_converts_other_dtypes(make_pool, dtype):
    m = kv_pool(make_pool, dtype)
    b = m.allocate_block().block_id
    k32 = rand(3, dtype="float32")
    m.write_kv(b, 0, k32, k32)
    rk, _ = m.read_kv([b], 0)
    assert rk.dtype == MXDT[dtype]
    assert np.array_equal(as_np(rk), as_np(k32.astype(MXDT[dtype])))


def test_layers_are_separate(make_pool):
    m = kv_pool(make_pool)
    b = m.allocate_block().block_id
    m.write_kv(b, 0, rand(1), rand(2))
    m.write_kv(b, 1, rand(3), rand(4))
    k0, v0 = m.read_kv([b], 0)
    k1, v1 = m.read_kv([b], 1)
    assert np.array_equal(as_np(k0), as_np(rand(1)))
    assert np.array_equal(as_np(k1), as_np(rand(3)))
    assert np.array_equal(as_np(v1), as_np(rand(4)))


def test_start_offset_writes_only_those_tokens(make_pool):
    m = kv_pool(make_pool)
    b = m.allocate_block().block_id
    full_k, full_v = rand(10), rand(11)
    m.write_kv(b, 0, full_k, full_v)
    part_k, part_v = rand(12, tokens=2), rand(13, tokens=2)
    m.write_kv(b, 0, part_k, part_v, start=1)
    rk, rv = m.read_kv([b], 0)
    rk, rv = as_np(rk), as_np(rv)
    assert np.array_equal(rk[:, 0], as_np(full_k)[:, 0])
    assert np.array_equal(rk[:, 1:3], as_np(part_k))
    assert np.array_equal(rk[:, 3], as_np(full_k)[:, 3])
    assert np.array_equal(rv[:, 1:3], as_np(part_v))
    # the last slot exactly
    m.write_kv(b, 0, rand(14, tokens=1), rand(15, tokens=1), start=T - 1)
    rk, _ = m.read_kv([b], 0)
    assert np.array_equal(as_np(rk)[:, T - 1], as_np(rand(14, tokens=1))[:, 0])


def test_read_order_follows_block_ids(make_pool):
    m = kv_pool(make_pool)
    ids = [b.block_id for b in m.get_new_blocks(3)]
    for i, b in enumerate(ids):
        m.write_kv(b, 0, rand(100 + i), rand(200 + i))
    order = [ids[2], ids[0], ids[1], ids[0]]
    rk, rv = m.read_kv(order, 0)
    assert rk.shape == (H, 4 * T, D) and rv.shape == (H, 4 * T, D)
    want_k = np.concatenate([as_np(rand(100 + ids.index(b))) for b in order], axis=1)
    want_v = np.concatenate([as_np(rand(200 + ids.index(b))) for b in order], axis=1)
    assert np.array_equal(as_np(rk), want_k)
    assert np.array_equal(as_np(rv), want_v)


def test_read_accepts_block_views(make_pool):
    m = kv_pool(make_pool)
    b = m.allocate_block()
    m.write_kv(b, 0, rand(1), rand(2))
    rk, _ = m.read_kv([b], 0)
    assert np.array_equal(as_np(rk), as_np(rand(1)))


def test_read_is_a_copy(make_pool):
    m = kv_pool(make_pool)
    b = m.allocate_block().block_id
    m.write_kv(b, 0, rand(1), rand(2))
    rk, _ = m.read_kv([b], 0)
    before = as_np(rk).copy()
    m.write_kv(b, 0, rand(5), rand(6))
    assert np.array_equal(as_np(rk), before)


def test_payload_visible_through_attached_manager(make_pool):
    m = kv_pool(make_pool)
    other = shmcache.attach(m.name)
    try:
        b = m.allocate_block().block_id
        m.write_kv(b, 1, rand(7), rand(8))
        rk, rv = other.read_kv([b], 1)
        assert np.array_equal(as_np(rk), as_np(rand(7)))
        assert np.array_equal(as_np(rv), as_np(rand(8)))
    finally:
        other.close()


def test_cache_data_of_a_live_block(make_pool):
    m = kv_pool(make_pool)
    b = m.allocate_block()
    b.cache_data = [(rand(1), rand(2)), (rand(3), rand(4))]
    data = b.cache_data
    assert len(data) == 2
    assert np.array_equal(as_np(data[1][0]), as_np(rand(3)))
    assert np.array_equal(as_np(data[0][1]), as_np(rand(2)))


@pytest.mark.parametrize("layer", [-1, 2, 99, 1.0, "0", True, None])
def test_bad_layer_raises(make_pool, layer):
    m = kv_pool(make_pool)
    b = m.allocate_block().block_id
    m.write_kv(b, 0, rand(1), rand(2))
    with pytest.raises(ValueError):
        m.write_kv(b, layer, rand(3), rand(4))
    with pytest.raises(ValueError):
        m.read_kv([b], layer)
    assert np.array_equal(as_np(m.read_kv([b], 0)[0]), as_np(rand(1)))


@pytest.mark.parametrize("shape", [(H, T, D + 1), (H + 1, T, D), (H, T + 1, D), (T, D), (1, H, T, D)])
def test_bad_shape_raises(make_pool, shape):
    m = kv_pool(make_pool)
    b = m.allocate_block().block_id
    m.write_kv(b, 0, rand(1), rand(2))
    bad = mx.zeros(shape, dtype=mx.float16)
    with pytest.raises(ValueError):
        m.write_kv(b, 0, bad, bad)
    with pytest.raises(ValueError):
        m.write_kv(b, 0, rand(3), bad)
    assert np.array_equal(as_np(m.read_kv([b], 0)[0]), as_np(rand(1)))


def test_keys_values_shape_mismatch_raises(make_pool):
    m = kv_pool(make_pool)
    b = m.allocate_block().block_id
    with pytest.raises(ValueError):
        m.write_kv(b, 0, rand(1, tokens=2), rand(2, tokens=3))


@pytest.mark.parametrize("start", [-1, T, 3, 1.5, True])
def test_bad_start_raises(make_pool, start):
    m = kv_pool(make_pool)
    b = m.allocate_block().block_id
    m.write_kv(b, 0, rand(1), rand(2))
    with pytest.raises(ValueError):
        m.write_kv(b, 0, rand(3, tokens=2), rand(4, tokens=2), start=start)
    assert np.array_equal(as_np(m.read_kv([b], 0)[0]), as_np(rand(1)))


@pytest.mark.parametrize("bid", [-1, 16, 1000, 1 << 70])
def test_bad_block_id_raises(make_pool, bid):
    m = kv_pool(make_pool)
    with pytest.raises(ValueError, match=f"block id {bid} out of range"):
        m.write_kv(bid, 0, rand(1), rand(2))
    for ids in ([1, bid], (bid,), [np.int64(2), bid] if bid < 1 << 63 else [bid]):
        with pytest.raises(ValueError, match=f"block id {bid} out of range"):
            m.read_kv(ids, 0)


@pytest.mark.parametrize("bad", [True, 1.0, "3", None])
def test_read_rejects_non_int_ids(make_pool, bad):
    m = kv_pool(make_pool)
    with pytest.raises(TypeError, match="block id must be an int"):
        m.read_kv([1, bad], 0)


def test_read_takes_every_form_of_id_list(make_pool):
    """Plain int lists, tuples, numpy ints, numpy arrays and
    generators all read the same blocks."""
    m = kv_pool(make_pool, "float32")
    m.pool.arena[...] = np.random.default_rng(5).standard_normal(m.pool.arena.shape)
    want = [np.array(x) for x in m.read_kv([3, 0, 15, 3], 1)]
    for ids in ((3, 0, 15, 3), [np.int64(3), 0, np.int32(15), 3], iter([3, 0, 15, 3]),
                np.array([3, 0, 15, 3])):
        got = [np.array(x) for x in m.read_kv(ids, 1)]
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_pool_without_arena(make_pool):
    m = make_pool(block_size=4, max_blocks=8, num_layers=0)
    b = m.allocate_block()
    assert m.layout.arena_size == 0
    with pytest.raises(ValueError):
        m.write_kv(b.block_id, 0, rand(1), rand(2))
    with pytest.raises(ValueError):
        m.read_kv([b.block_id], 0)
    assert b.cache_data is None


def test_default_pool_has_small_arena():
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=8)
    try:
        lay = m.layout
        assert lay.num_layers >= 1 and lay.arena_size > 0
        b = m.allocate_block().block_id
        k = mx.ones((lay.num_kv_heads, 4, lay.head_dim), dtype=mx.float16)
        m.write_kv(b, 0, k, k * 2)
        rk, rv = m.read_kv([b], 0)
        assert float(rk.sum()) == k.size and float(rv.sum()) == 2 * k.size
    finally:
        m.close()


# ---------------------------------------------------------------- whose block
def test_write_refuses_the_null_block(make_pool):
    m = kv_pool(make_pool)
    before = m.pool.arena[:, 0].tobytes()
    with pytest.raises(ValueError, match="null block"):
        m.write_kv(0, 0, rand(1), rand(2))
    assert m.pool.arena[:, 0].tobytes() == before


def test_write_refuses_blocks_not_held(make_pool):
    """A free block (another process may allocate it at any moment) or
    another manager's block (a prefix others read) is not the caller's to
    write; its bytes stay as they were."""
    m = kv_pool(make_pool)
    other = shmcache.attach(m.name)
    try:
        theirs = other.allocate_block().block_id
        other.write_kv(theirs, 0, rand(1), rand(2))
        mine = m.allocate_block().block_id
        m.free_block(mine)                           # free again
        for b in (theirs, mine, 9):
            before = m.pool.arena[:, b].tobytes()
            with pytest.raises(ValueError, match=f"block {b} is not held by this manager"):
                m.write_kv(b, 0, rand(3), rand(4))
            assert m.pool.arena[:, b].tobytes() == before
        assert m.check() == []
    finally:
        other.close()


def test_write_takes_blocks_of_its_own_tables(make_pool):
    """Table references count: a prepared table's blocks, a fork's blocks
    after copy-on-write, not the table's once deleted or another manager's."""
    m = kv_pool(make_pool)
    t = m.create_block_table("a")
    blocks = m.prepare_append(t, T + 2)
    for b in blocks:
        m.write_kv(b.block_id, 0, rand(1), rand(2))
    f = m.fork_block_table(t, "b")
    (copy,) = m.prepare_append(f, 1)                 # the shared partial block is copied
    assert copy.block_id not in [b.block_id for b in blocks]
    m.write_kv(copy.block_id, 1, rand(3), rand(4))
    m.write_kv(blocks[0].block_id, 1, rand(5), rand(6))
    other = shmcache.attach(m.name)
    try:
        with pytest.raises(ValueError, match="not held"):
            other.write_kv(copy.block_id, 0, rand(7), rand(8))
        ot = other.create_block_table("c")
        (ob,) = other.prepare_append(ot, 1)
        other.write_kv(ob.block_id, 0, rand(7), rand(8))
        with pytest.raises(ValueError, match="not held"):
            m.write_kv(ob.block_id, 0, rand(7), rand(8))
    finally:
        other.close()
    m.delete_block_table("b")
    with pytest.raises(ValueError, match=f"block {copy.block_id} is not held"):
        m.write_kv(copy.block_id, 0, rand(9), rand(9))


# ---------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("bad", [mx.int32, mx.int8, mx.uint16, mx.bool_, mx.complex64,
                                 np.int64, np.int16, np.complex128, np.bool_])
def test_write_refuses_non_float_arrays(make_pool, dtype, bad):
    """Integer, boolean and complex arrays were cast silently (complex lost
    its imaginary part). A float of another width is converted, as before;
    a bfloat16 pool keeps taking raw uint16 words from numpy."""
    m = kv_pool(make_pool, dtype)
    b = m.allocate_block().block_id
    m.write_kv(b, 0, rand(1, dtype=dtype), rand(2, dtype=dtype))
    before = m.pool.arena[:, b].tobytes()
    x = (mx.ones((H, T, D), dtype=bad) if isinstance(bad, mx.Dtype)
         else np.ones((H, T, D), dtype=bad))
    with pytest.raises(TypeError, match="floating-point|bfloat16 pool takes"):
        m.write_kv(b, 0, x, x)
    with pytest.raises(TypeError):
        m.write_kv(b, 0, rand(3, dtype=dtype), x)     # either one
    assert m.pool.arena[:, b].tobytes() == before


def test_write_converts_numpy_floats(make_pool):
    m = kv_pool(make_pool, "float16")
    b = m.allocate_block().block_id
    x = np.random.default_rng(0).standard_normal((H, T, D))     # float64
    m.write_kv(b, 0, x, x.astype(np.float32))
    assert np.array_equal(as_np(m.read_kv([b], 0)[0]), x.astype(np.float16).astype(np.float32))

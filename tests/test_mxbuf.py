"""shmcache.mxbuf: new MLX arrays written in place (the native module, and mx.load)."""

from __future__ import annotations

import gc
import io

import mlx.core as mx
import numpy as np
import pytest

from shmcache import mxbuf

from _helpers import layer_kv


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


class Recorder:
    """A fill that writes `data`, counting its calls and noting the view's address."""

    def __init__(self, data: np.ndarray):
        self.data, self.calls, self.addresses = data, 0, []

    def __call__(self, view: np.ndarray) -> None:
        self.calls += 1
        self.addresses.append(view.ctypes.data)
        assert view.dtype == np.uint8 and view.shape == self.data.shape
        view[:] = self.data


def as_np(a: mx.array) -> np.ndarray:
    return np.array(a, copy=False)


SIZES = [1, 63, 64, 4097, 3 << 20]


@pytest.mark.parametrize("n", SIZES)
def test_filled_returns_what_fill_wrote(n):
    want = payload(n)
    fill = Recorder(want)
    a = mxbuf.filled(n, fill)
    assert isinstance(a, mx.array) and a.dtype == mx.uint8 and a.shape == (n,)
    assert as_np(a).tobytes() == want.tobytes()
    assert fill.calls == 1


def test_filled_empty():
    # No payload to read through mx.load: fill still gets its (empty) call.
    fill = Recorder(payload(0))
    a = mxbuf.filled(0, fill)
    assert a.dtype == mx.uint8 and a.shape == (0,) and fill.calls == 1
    assert mxbuf._load_works


@pytest.mark.parametrize("n", SIZES)
def test_fill_writes_straight_into_the_array(n):
    # With MLX 0.32 mx.load asks for the whole payload in one readinto, so
    # fill's view is the array's own memory (no staging copy).
    fill = Recorder(payload(n))
    a = mxbuf.filled(n, fill)
    assert fill.addresses == [as_np(a).ctypes.data]
    assert mxbuf._load_works


def test_results_are_independent():
    a = mxbuf.filled(4096, Recorder(payload(4096, 1)))
    b = mxbuf.filled(4096, Recorder(payload(4096, 1)))
    assert as_np(a).ctypes.data != as_np(b).ctypes.data
    as_np(a)[:] = 0
    assert as_np(b).tobytes() == payload(4096, 1).tobytes()
    assert not as_np(a).any()


@pytest.mark.parametrize("n", [0, 1, 54, 55, 56, 4097, 10**12])
def test_header_is_valid_npy(n):
    h = mxbuf._header(n)
    f = io.BytesIO(h)
    assert np.lib.format.read_magic(f) == (1, 0)
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    assert (shape, fortran, dtype) == ((n,), False, np.dtype(np.uint8))
    assert f.tell() == len(h) and len(h) % 64 == 0


def test_header_round_trips_through_numpy():
    data = payload(1000)
    assert np.array_equal(np.load(io.BytesIO(mxbuf._header(1000) + data.tobytes())), data)


def read_all(s: mxbuf._Stream, piece: int) -> bytes:
    out = bytearray()
    while True:
        buf = bytearray(piece)
        k = s.readinto(memoryview(buf))
        assert 0 <= k <= piece
        if k == 0:
            return bytes(out)
        out += buf[:k]


@pytest.mark.parametrize("piece", [7, 100, 1000, 1 << 20])
def test_stream_served_in_pieces(piece):
    n = 5000
    fill = Recorder(payload(n))
    s = mxbuf._Stream(n, fill)
    assert read_all(s, piece) == mxbuf._header(n) + fill.data.tobytes()
    assert fill.calls == 1                      # staged once, served from there
    assert s.tell() == len(mxbuf._header(n)) + n
    assert s.in_place is (piece >= n)           # 1 MiB pieces get the payload in one read


def test_stream_read_seek_tell():
    n, h = 300, len(mxbuf._header(300))
    fill = Recorder(payload(n))
    s = mxbuf._Stream(n, fill)
    assert s.readable() and s.seekable() and s.tell() == 0
    assert s.read(10) == mxbuf._header(n)[:10] and s.tell() == 10
    assert s.seek(h + 5) == h + 5 and s.seek(10, 1) == h + 15
    assert s.read(3) == fill.data[15:18].tobytes() and s.tell() == h + 18
    assert s.seek(-20, 2) == h + n - 20 and s.read(100) == fill.data[-20:].tobytes()
    assert s.read() == b"" and s.read(5) == b""
    assert s.seek(h) == h and s.read() == fill.data.tobytes()   # the rest, from the payload start
    assert s.seek(-10**6, 1) == 0               # clamped at the start
    assert s.read(h) == mxbuf._header(n)
    assert fill.calls == 1                      # staged on the first payload read, reused


def test_stream_read_all_from_start():
    fill = Recorder(payload(300))
    assert mxbuf._Stream(300, fill).read() == mxbuf._header(300) + fill.data.tobytes()


class FillFailed(Exception):
    pass


def test_fill_exception_propagates():
    def fill(view):
        view[:10] = 1
        raise FillFailed("no data for block 7")

    assert mxbuf._load_works
    with pytest.raises(FillFailed, match="^no data for block 7$"):
        mxbuf.filled(4096, fill)
    assert mxbuf._load_works                    # a failing fill is not MLX refusing streams
    assert as_np(mxbuf.filled(64, Recorder(payload(64)))).tobytes() == payload(64).tobytes()


def test_fill_exception_while_staging_is_kept():
    s = mxbuf._Stream(100, lambda v: (_ for _ in ()).throw(FillFailed("x")))
    s.seek(len(mxbuf._header(100)))
    assert s.readinto(bytearray(10)) == 0 and isinstance(s.error, FillFailed)


def test_falls_back_to_zeros_when_load_refuses(monkeypatch):
    calls = []

    def refuse(*a, **kw):
        calls.append(a)
        raise ValueError("streams not supported")

    monkeypatch.setattr(mxbuf.mx, "load", refuse)
    monkeypatch.setattr(mxbuf, "_load_works", True)
    for n in (4097, 63):
        fill = Recorder(payload(n))
        a = mxbuf.filled(n, fill)
        assert a.dtype == mx.uint8 and a.shape == (n,) and fill.calls == 1
        assert as_np(a).tobytes() == fill.data.tobytes()
        assert mxbuf._load_works is False
    assert len(calls) == 1                      # once refused, not tried again


# -- the native module (shmcache._mlxbuf) ------------------------------------

native = pytest.mark.skipif(mxbuf.native is None, reason="shmcache._mlxbuf is not usable here")


@native
def test_native_is_refused_for_another_mlx_version(monkeypatch):
    assert mxbuf._load_native() is mxbuf.native
    monkeypatch.setattr(mxbuf.native, "MLX_VERSION", "0.0.1")
    assert mxbuf._load_native() is None
    monkeypatch.setenv("SHMCACHE_PURE", "1")
    monkeypatch.undo()
    monkeypatch.setenv("SHMCACHE_PURE", "1")
    assert mxbuf._load_native() is None


# -- native read_layer: a whole KV read in one call ----------------------------

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


@native
@pytest.mark.parametrize("dtype", list(STORAGE))
@pytest.mark.parametrize("layer", [0, 2])
def test_native_read_layer_gathers_in_block_order(dtype, layer):
    arena = arena_of(dtype=dtype)
    ids = [9, 2, 2, 0, 7]
    want = layer_kv(arena, ids, layer)
    k, v = mxbuf.native.read_layer(arena, ids, layer, STORAGE[dtype][1], 1, 1 << 30)
    for got, w in ((k, want[0]), (v, want[1])):
        assert got.dtype == STORAGE[dtype][1] and got.shape == (3, 5 * 4, 8)
        assert np.array_equal(raw_of(got), w)
    arena[...] = 0                                   # a copy: later writes do not show
    assert np.array_equal(raw_of(k), want[0]) and np.array_equal(raw_of(v), want[1])
    # MLX computes on them like on any array
    if dtype == "float32":
        assert np.allclose(np.array((k[:, 4:] * 2).sum(axis=1)), 2 * want[0][:, 4:].sum(axis=1))


@native
@pytest.mark.parametrize("skew", [0, 64, 2052, 2])
def test_native_read_layer_lands_at_the_sources_page_offsets(skew):
    arena = arena_of(shape=(2, 16, 2, 2, 8, 16), dtype="float32", skew=skew)
    ids = [15, 3, 8]
    k, v = mxbuf.native.read_layer(arena, ids, 1, mx.float32, 1, 1 << 30)
    for x, kv in ((k, 0), (v, 1)):
        gap = (arena[1, 0, kv].ctypes.data - as_np(x).ctypes.data) % 4096
        # where the arena's items are not item-aligned, the nearest whole item before
        assert gap == skew % 4
    want = layer_kv(arena, ids, 1)
    assert np.array_equal(as_np(k), want[0]) and np.array_equal(as_np(v), want[1])


@native
def test_native_read_layer_threads_agree():
    arena = arena_of(shape=(1, 64, 2, 4, 4, 8), dtype="float32", seed=4)
    ids = np.random.default_rng(1).permutation(64)[:50].tolist()
    want = layer_kv(arena, ids, 0)
    for threads in (1, 2, 3, 8, 50):
        k, v = mxbuf.native.read_layer(arena, ids, 0, mx.float32, threads, 0)
        assert np.array_equal(as_np(k), want[0]) and np.array_equal(as_np(v), want[1])


@native
@pytest.mark.parametrize("above", [(0, 0), (0, 1 << 62), (1 << 62, 0), (1 << 62, 1 << 62)])
def test_native_read_layer_streamed_or_not_alone_or_shared(above):
    # 8 MiB of K and V in 4 KiB chunks on two threads: streamed or ordinary
    # stores for what the caller copies alone and for what it shares.
    arena = arena_of(shape=(1, 600, 2, 4, 32, 32), dtype="float32", seed=6)
    ids = np.random.default_rng(2).permutation(600)[:512].tolist()
    want = layer_kv(arena, ids, 0)
    k, v = mxbuf.native.read_layer(arena, ids, 0, mx.float32, 2, 0, *above)
    assert np.array_equal(as_np(k), want[0]) and np.array_equal(as_np(v), want[1])


@native
def test_native_pool_stats_count_threaded_reads():
    arena = arena_of(shape=(1, 64, 2, 4, 4, 8), dtype="float32", seed=5)
    before = mxbuf.native.pool_stats()
    assert set(before) == {"helpers", "shared", "skipped", "backoffs"}
    mxbuf.native.read_layer(arena, list(range(40)), 0, mx.float32, 2, 0)    # shares or skips
    mxbuf.native.read_layer(arena, list(range(40)), 0, mx.float32, 1, 0)    # one thread: neither
    after = mxbuf.native.pool_stats()
    assert after["shared"] + after["skipped"] == before["shared"] + before["skipped"] + 1
    assert after["helpers"] >= 1


@native
def test_native_read_layer_keeps_its_buffer_alive():
    arena = arena_of(dtype="float32")
    want = layer_kv(arena, [1, 4], 0)
    k, v = mxbuf.native.read_layer(arena, [1, 4], 0, mx.float32, 1, 1 << 30)
    del k
    gc.collect()
    mx.eval(mx.zeros(v.nbytes * 2, dtype=mx.uint8) + 1)  # would likely reuse a freed buffer
    assert np.array_equal(as_np(v), want[1])


@native
def test_native_read_layer_of_no_blocks():
    k, v = mxbuf.native.read_layer(arena_of(), [], 1, mx.float16, 1, 1 << 30)
    assert k.shape == v.shape == (3, 0, 8) and k.dtype == mx.float16


@native
@pytest.mark.parametrize("ids", [np.array([1, 2]), iter([1, 2]), [1, np.int64(2)], [1, True],
                                 [1, -1], [10], [1, 1 << 70], [1.0], ["1"], None, 3])
def test_native_read_layer_declines_what_it_does_not_take(ids):
    # None: the caller's own path checks such ids (and says what is wrong).
    assert mxbuf.native.read_layer(arena_of(), ids, 0, mx.float16, 1, 1 << 30) is None


@native
def test_native_read_layer_rejects_a_bad_arena_layer_or_dtype():
    a = arena_of()
    with pytest.raises(ValueError, match="arena must be a C-contiguous"):
        mxbuf.native.read_layer(a[0], [1], 0, mx.float16, 1, 1 << 30)
    with pytest.raises(ValueError, match="arena must be a C-contiguous"):
        mxbuf.native.read_layer(np.zeros((1, 4, 3, 1, 2, 2), np.float16), [1], 0, mx.float16, 1, 1 << 30)
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        mxbuf.native.read_layer(a[..., ::2], [1], 0, mx.float16, 1, 1 << 30)
    for layer in (-1, 3):
        with pytest.raises(ValueError, match=rf"layer {layer} not in \[0, 3\)"):
            mxbuf.native.read_layer(a, [1], layer, mx.float16, 1, 1 << 30)
    with pytest.raises(ValueError, match="item size"):
        mxbuf.native.read_layer(a, [1], 0, mx.float32, 1, 1 << 30)

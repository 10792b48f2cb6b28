"""shmcache.mxbuf: new MLX uint8 arrays written in place through mx.load."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from shmcache import mxbuf


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

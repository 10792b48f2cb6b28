"""New MLX arrays written in place by the caller, without MLX's zero fill.

MLX has no uninitialised arrays and cannot adopt CPU memory it did not
allocate, so the obvious way to fill a new MLX array from our own code is
``mx.zeros`` and writing into a numpy view of it: a full memset and a hand-off
to MLX's stream thread before the real write. Two ways round that:

- ``native`` (``shmcache._mlxbuf``, C++, where it was built against this very
  MLX version and passes a self-check): ``native.read_layer`` does a whole KV
  read in one call (``kv.read_fast``), into an unwritten buffer from MLX's
  allocator, in the calling thread. ``None`` where it is not usable (or
  ``SHMCACHE_PURE`` is set).
- ``filled(nbytes, fill)``, with MLX's Python API only: ``mx.load`` is the one
  public call that allocates an array and lets Python write its bytes, since
  loading a ``.npy`` stream hands the stream's ``readinto`` the new array's
  memory. ``filled`` serves such a stream whose payload ``fill`` writes.

NOTE: only speed depends on how MLX reads the stream. When it asks for the
whole payload in one ``readinto`` (MLX 0.32), ``fill`` writes straight into
the array's memory; if it reads any other way, the payload is made once in a
numpy buffer and served from there; and if ``mx.load`` refuses the stream
altogether, ``filled`` falls back to ``mx.zeros`` for good. Each way gives
the same bytes.
"""

from __future__ import annotations

import os
import struct
from typing import Callable

import mlx.core as mx
import numpy as np

Fill = Callable[[np.ndarray], None]
_load_works = True


def _load_native():
    if os.environ.get("SHMCACHE_PURE"):
        return None
    try:
        from shmcache import _mlxbuf
    except ImportError:
        return None
    # NOTE: the module uses MLX's backend API, whose layout may change between
    # versions: only the exact version it was compiled against is trusted,
    # and only if a round trip gives back what was written.
    if _mlxbuf.MLX_VERSION != mx.__version__:
        return None
    try:
        arena = np.arange(24, dtype=np.float32).reshape(1, 3, 2, 1, 2, 2)   # (L, M, 2, H, T, D)
        k, kv_v = _mlxbuf.read_layer(arena, [2, 0], 0, mx.float32, 1, 1 << 30)
        ok = (isinstance(k, mx.array) and k.dtype == mx.float32 and k.shape == (1, 4, 2)
              and np.array_equal(np.array(k), arena[0, [2, 0], 0].transpose(1, 0, 2, 3).reshape(1, 4, 2))
              and np.array_equal(np.array(kv_v), arena[0, [2, 0], 1].transpose(1, 0, 2, 3).reshape(1, 4, 2)))
    except Exception:
        return None
    return _mlxbuf if ok else None


native = _load_native()


def _header(nbytes: int) -> bytes:
    # .npy format 1.0: magic, header length, a dict padded so that the
    # payload starts 64-byte aligned.
    d = "{'descr': '|u1', 'fortran_order': False, 'shape': (%d,), }" % nbytes
    pad = 63 - (10 + len(d)) % 64
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(d) + pad + 1) + d.encode() + b" " * pad + b"\n"


class _Stream:
    """A read-only binary stream: a .npy header for ``nbytes`` uint8, then the
    payload that ``fill`` writes (see the module docstring)."""

    closed = False
    mode = "rb"

    def __init__(self, nbytes: int, fill: Fill):
        self._head = _header(nbytes)
        self._end = len(self._head) + nbytes
        self._fill = fill
        self._pos = 0
        self._staged = None       # the payload, when it is not read in one piece
        self.in_place = False     # whether fill wrote straight into the reader's memory
        self.error = None         # what fill raised (MLX reports only a failed read)

    def readinto(self, buf) -> int:
        mv = memoryview(buf).cast("B")
        h, pos = len(self._head), self._pos
        if pos < h:
            k = min(len(mv), h - pos)
            mv[:k] = self._head[pos:pos + k]
        else:
            k = min(len(mv), self._end - pos)
            if k <= 0:
                return 0
            try:
                if pos == h and k == self._end - h and self._staged is None:
                    self._fill(np.frombuffer(mv, dtype=np.uint8, count=k))
                    self.in_place = True
                else:
                    if self._staged is None:
                        self._staged = np.empty(self._end - h, dtype=np.uint8)
                        self._fill(self._staged)
                    mv[:k] = self._staged[pos - h:pos - h + k]
            except BaseException as e:        # re-raised by filled()
                self.error = e
                return 0
        self._pos = pos + k
        return k

    def read(self, size: int = -1) -> bytes:
        n = self._end - self._pos if size is None or size < 0 else min(size, self._end - self._pos)
        out, got = bytearray(max(n, 0)), 0
        while got < len(out):                 # the header and the payload are separate reads
            k = self.readinto(memoryview(out)[got:])
            if k == 0:
                break
            got += k
        return bytes(out[:got])

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._end)[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def filled(nbytes: int, fill: Fill) -> mx.array:
    """A new, evaluated MLX uint8 array of ``nbytes`` written by ``fill``.

    Args:
        nbytes: size of the array.
        fill: called once with a writable numpy uint8 view of ``nbytes``; it
            must write every byte. The view may be the array's own memory or
            a staging buffer copied into it, so ``fill`` may look at its
            address (to align what it writes) but must not keep it.

    Returns:
        The array (shape ``(nbytes,)``, dtype uint8).

    Raises:
        Whatever ``fill`` raises.
    """
    global _load_works
    if _load_works and nbytes > 0:
        s = _Stream(nbytes, fill)
        try:
            a = mx.load(s, format="npy")
            mx.eval(a)
            return a
        except Exception:
            if s.error is not None:
                raise s.error from None
            if s._pos > len(s._head):
                raise
            _load_works = False               # this MLX does not take streams: stop trying
    a = mx.zeros((nbytes,), dtype=mx.uint8)
    mx.eval(a)
    fill(np.array(a, copy=False))
    return a

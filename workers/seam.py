"""The model's window onto the shared pool: one request's (one sample's) K/V.

Implements ``workers.model.KVCacheSeam`` over a block table: at layer 0 of
each forward pass it reserves room with ``prepare_append`` (which copies a
shared, partly filled last block first), then every layer writes this
chunk's K/V into the blocks with ``write_kv`` and reads the request's whole
K/V back with ``read_kv``. Nothing else of the pool is visible to the model.
"""

from __future__ import annotations

import mlx.core as mx

from shmcache import kv as _kv


class PagedKVSeam:
    """K/V of one block table. ``offset`` counts the tokens already stored."""

    def __init__(self, mgr, table, offset: int = 0) -> None:
        self.mgr = mgr
        self.table = table
        self._offset = offset
        self._ids: list = []
        self._new: list = []
        self._pending = 0

    @property
    def offset(self) -> int:
        return self._offset

    def update_and_fetch(self, layer: int, keys: mx.array, values: mx.array):
        T = keys.shape[1]  # keys: (H, T, D)
        if layer == 0:
            # Raises OutOfBlocksError before anything changes when the pool is full.
            self._new = self.mgr.prepare_append(self.table, T)
            self._ids = self.table.block_ids
            self._pending = T
        bs = self.mgr.block_size
        p = self.mgr._p
        k = _kv.as_storage(p, keys)  # one eval, then zero-copy numpy views
        v = _kv.as_storage(p, values)
        pos, done = self._offset, 0
        for blk in self._new:
            start = pos % bs
            n = min(bs - start, T - done)
            self.mgr.write_kv(blk.block_id, layer, k[:, done:done + n], v[:, done:done + n], start)
            pos += n
            done += n
        k_all, v_all = self.mgr.read_kv(self._ids, layer)  # (H, blocks*bs, D)
        end = self._offset + T
        return k_all[:, :end], v_all[:, :end]

    def advance(self, n: int) -> None:
        if n != self._pending:
            raise RuntimeError(f"advance({n}) after a chunk of {self._pending} tokens")
        self._offset += n
        self._pending = 0

    def fork(self, table) -> "PagedKVSeam":
        return PagedKVSeam(self.mgr, table, self._offset)

"""The manager's K/V payload operations: writing, reading and moving the
K/V of the blocks it holds.

``KVArena`` is one owner of a ``PagedCacheManager``; its collaborator is
the ``core.BlockLedger`` (which blocks this process holds), given to its
constructor. The arena's bytes and the copies are ``shmcache.manager.kv``'s. These
calls are shmcache's own (the seed keeps a block's tensors in a Python
object, ``cache_data``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import kv
from ..shm.blocks import BlockTable

if TYPE_CHECKING:
    from .core import BlockLedger


class KVArena:
    """K/V writes, reads and whole-block copies for one process's manager.

    Invariant: a manager writes only the K/V of blocks it holds (loose or in
    a table it owns), checked before the write; the write itself, and every
    read, runs outside the lock.
    """

    def __init__(self, ledger: "BlockLedger") -> None:
        self.ledger = ledger
        self.pool = ledger.pool
        self.block_size = ledger.block_size

    def write_kv(self, block_id: int, layer: int, keys, values, start: int = 0) -> None:
        """Write K/V of shape (num_kv_heads, T, head_dim) into a block at ``start``.

        Keys and values must be floating-point arrays (MLX or numpy; another
        float width is converted to the pool's dtype).

        Raises:
            ValueError: the null block, a block this manager holds no
                reference to (neither loose nor in a table it owns), or a bad
                layer, shape or start. TypeError: a dtype that is not floating.
        """
        b = self.ledger.bid(block_id)
        p = self.pool
        kv.check_layer(p, layer)
        if b == 0:
            raise ValueError("cannot write K/V into the null block (block 0)")
        p.check_usable()
        # (the check needs no lock when what it knows is current: the write
        # itself is outside the lock either way, as is any use of a block
        # this manager holds)
        if not self.ledger.holds_fast(b):
            with p.lock:
                self.ledger.sync()
                if not self.ledger.holds(b):
                    raise ValueError(
                        f"block {b} is not held by this manager: allocate or acquire it, or "
                        "add it to one of its block tables, before writing its K/V")
        kv.write(p, b, layer, keys, values, start)

    def export_blocks(self, block_ids) -> np.ndarray:
        """A copy of whole blocks' K/V in the storage dtype, every layer at once.

        For moving blocks between tiers (the L2 tier): one copy of n blocks
        instead of a read per block and layer. bfloat16 pools give raw
        uint16 words.

        Args:
            block_ids: ids (or blocks) this manager holds.
        Returns:
            ``# (L, n, 2, H, T, D)`` array; ``[:, i, 0]`` keys, ``[:, i, 1]`` values.
        Raises:
            ValueError: the null block, or a block this manager does not hold.
        """
        ids = self._checked_held(block_ids)
        return self.pool.arena[:, ids]

    def import_blocks(self, block_ids, data) -> None:
        """Write whole blocks' K/V, the inverse of :meth:`export_blocks`.

        Args:
            block_ids: n ids this manager holds (fresh, unpublished blocks:
                published ones are read by others).
            data: ``# (L, n, 2, H, T, D)`` in the storage dtype (raw uint16
                words for bfloat16), or layers ``lo:hi`` of it with ``layers``.
        Raises:
            ValueError: the null block, an unheld block, or a shape or dtype
                that is not the pool's.
        """
        ids = self._checked_held(block_ids)
        a = self.pool.arena
        data = np.asarray(data)
        want = (a.shape[0], len(ids)) + a.shape[2:]
        if data.shape != want or data.dtype != a.dtype:
            raise ValueError(f"block payloads must be {want} {a.dtype}, "
                             f"not {data.shape} {data.dtype}")
        a[:, ids] = data

    def _checked_held(self, block_ids) -> list:
        ids = self.ledger.bids(block_ids)
        p = self.pool
        p.check_usable()
        for b in ids:
            if b == 0:
                raise ValueError("the null block (block 0) has no K/V")
        if not all(self.ledger.holds_fast(b) for b in ids):
            with p.lock:
                self.ledger.sync()
                for b in ids:
                    if not self.ledger.holds(b):
                        raise ValueError(f"block {b} is not held by this manager")
        return ids

    def append_kv(self, table: BlockTable, layer: int, keys, values, start: int) -> None:
        """Write a span of K/V, (num_kv_heads, T, head_dim), into ``table`` at
        token position ``start``, across as many blocks as it covers.

        The positions must already be in the table (``prepare_append``).

        Raises:
            ValueError: the span is not within the table's tokens, or a
                shape, layer or dtype is wrong (as ``write_kv``).
        """
        T = int(keys.shape[1])
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 \
                or start + T > table.num_tokens:
            raise ValueError(f"append_kv: tokens {start}..{start + T} are not within the "
                             f"table's {table.num_tokens} tokens (prepare_append first)")
        ids = table.block_ids
        bs, done = self.block_size, 0
        while done < T:
            pos = start + done
            n = min(bs - pos % bs, T - done)
            self.write_kv(ids[pos // bs], layer, keys[:, done:done + n], values[:, done:done + n],
                          pos % bs)
            done += n

    def read_kv(self, block_ids, layer: int):
        """Gather blocks' K/V of one layer into MLX arrays (num_kv_heads, n*block_size, head_dim)."""
        p = self.pool
        kv.check_layer(p, layer)
        p.check_usable()
        out = kv.read_fast(p, block_ids, layer)    # plain int ids, where built
        return out if out is not None else kv.read(p, self.ledger.bids(block_ids), layer)


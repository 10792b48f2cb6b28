"""The L2 of one pool manager: what ``shmcache.models.mlx_lm`` and the server call.

:meth:`L2Tier.start` runs after an L1 lookup: it asks Redis for the chain's
next blocks on the store's fetch thread (the whole lookup bounded by
``timeout``); :meth:`L2Tier.install`, on the caller's thread, writes what
arrived into fresh pool blocks (``mgr.import_blocks``), appends them to the
table and publishes them in L1. :meth:`L2Tier.load` is both, waiting.
:meth:`L2Tier.write_back` runs after a publish: it copies the blocks
(``mgr.export_blocks``) and queues them for the writer thread. This
process's counters reach the pool-wide ones (``l2_<name>``, what
``shmcache inspect`` shows) from the writer thread, every ``FLUSH_S``.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Callable, List, Optional, Sequence

import numpy as np

from .codec import DEFAULT_MAX_VALUE, Codec, KVLayout
from .store import DEFAULT_QUEUE_BYTES, DEFAULT_RETRY, DEFAULT_TIMEOUT, RedisL2

log = logging.getLogger("shmcache.l2")


def pool_counter_sink(mgr) -> Callable[[dict], None]:
    """A sink adding counter deltas to ``mgr``'s pool-wide L2 counters.

    It holds the manager weakly: the writer thread keeps its sink for as long
    as it runs, and must not keep a manager nobody else holds alive.
    """
    wmgr = weakref.ref(mgr)

    def sink(deltas: dict) -> None:
        m = wmgr()
        if m is not None:
            m.add_counters({f"l2_{k}": d for k, d in deltas.items()})
    return sink


def read_blocks(mgr, ids: Sequence[int]) -> np.ndarray:
    """A copy of held blocks' K/V, ``# (L, n, 2, H, T, D)`` in the storage dtype."""
    return mgr.export_blocks([int(b) for b in ids])


def write_blocks(mgr, codec: Codec, ids: Sequence[int], payloads: List[List[memoryview]]) -> None:
    """Write loaded payloads into blocks this manager holds (and nobody else
    does: fresh from ``get_new_blocks``)."""
    mgr.import_blocks([int(b) for b in ids], codec.blocks_array(payloads))


class L2Tier:
    """The L2 of one pool manager.

    Args:
        mgr: the manager (a worker's).
        url: the Redis URL.
        model_id: the model's identity (``identity.model_identity``).
        secret: the L2 secret (bytes); pools share entries only under one.
        timeout: seconds a lookup has, as a whole; retry_s, ttl,
            queue_bytes, write_timeout: as :class:`~shmcache.l2.store.RedisL2`.
        max_value_bytes: as :class:`~shmcache.l2.codec.Codec`.
    Raises:
        ValueError: a bad URL or an empty secret. RuntimeError: no redis-py.
    """

    def __init__(self, mgr, url: str, *, model_id: str, secret: bytes,
                 timeout: float = DEFAULT_TIMEOUT, retry_s: float = DEFAULT_RETRY,
                 ttl: Optional[int] = None, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 max_value_bytes: int = DEFAULT_MAX_VALUE, write_timeout: Optional[float] = None
                 ) -> None:
        self.mgr = mgr
        self.bs = mgr.block_size
        self.codec = Codec(KVLayout.of(mgr, model_id), secret, max_value_bytes)
        self.store = RedisL2(url, self.codec, timeout=timeout, retry_s=retry_s, ttl=ttl,
                             queue_bytes=queue_bytes, write_timeout=write_timeout,
                             sink=pool_counter_sink(mgr))
        self._failed_once = False

    def chain(self, tokens, n_blocks: int, extra_keys=None, prev=None) -> List[bytes]:
        """Chain hashes of the first ``n_blocks`` blocks (``Codec.chain``)."""
        return self.codec.chain(tokens, n_blocks, extra_keys, prev)

    def start(self, first: int, chain: Sequence[bytes]):
        """Start looking up the blocks after an L1 hit of ``first`` blocks
        (``chain``: the chain hashes from block 0) on the fetch thread;
        the lookup ends by ``timeout`` from now (``RedisL2.start``).
        Returns the :class:`~shmcache.l2.store.Lookup` for :meth:`install`."""
        return self.store.start(list(chain[first:]))

    def load(self, table, tokens, extra_keys, first: int, chain: Sequence[bytes]) -> int:
        """Load the blocks after an L1 hit from L2 into the pool, waiting for
        them up to the lookup's deadline: :meth:`start`, then :meth:`install`."""
        lk = self.start(first, chain)
        return self.install(table, tokens, extra_keys, first, lk.wait())

    def install(self, table, tokens, extra_keys, first: int, found) -> int:
        """Write blocks that arrived from L2 into the pool and publish them.

        Runs on the thread that owns ``table`` (the pool is never touched
        by the fetch thread).

        Args:
            table: the sequence's block table, holding the L1 hit (``first``
                whole blocks) and nothing more.
            tokens: the sequence's tokens (at least ``first + len(found)`` blocks).
            extra_keys: the tenant salt.
            first: blocks already in ``table``.
            found: the payloads that arrived (``Lookup.take``), the blocks
                after ``first``, in order.
        Returns:
            How many blocks were appended to ``table`` and published in L1.
            0 for a full pool or a failed write: never raises for either.
        """
        if not found:
            return 0
        t1 = time.perf_counter()
        from ..errors import OutOfBlocksError
        mgr = self.mgr
        try:
            blocks = mgr.get_new_blocks(len(found))
        except OutOfBlocksError:
            return 0                   # the prefill will wait for room as usual
        ids = [b.block_id for b in blocks]
        try:
            write_blocks(mgr, self.codec, ids, found)
        except Exception:
            mgr.free_block_batch(ids)
            self.store.c.add("errors")
            if not self._failed_once:
                self._failed_once = True
                log.exception("loading blocks from L2 failed; computing them")
            return 0
        t2 = time.perf_counter()
        for b in blocks:
            mgr.add_block_to_table(table, b, self.bs)
        n = first + len(found)
        mgr.cache_full_blocks(table.block_ids[:n], list(tokens[:n * self.bs]), first, n,
                              extra_keys)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("L2: %d blocks after %d from L1: K/V into the pool %.1f ms, into the "
                      "table and published %.1f ms", len(found), first, (t2 - t1) * 1e3,
                      (time.perf_counter() - t2) * 1e3)
        return len(found)

    def write_back(self, ids: Sequence[int], chain: Sequence[bytes]) -> None:
        """Queue published blocks (held by the caller) for Redis; dropped
        (counted) when the queue is full or Redis is down."""
        if not ids:
            return
        per = self.codec.layout.block_bytes
        if not self.store.accepting(per * len(ids)):
            self.store.c.add("dropped", len(ids))
            return
        self.store.put(chain, read_blocks(self.mgr, ids))

    def stats(self) -> dict:
        """This process's counters (``RedisL2.stats``)."""
        return self.store.stats()

    def close(self, flush_s: float = 1.0) -> None:
        """Write what is queued (up to ``flush_s``), stop, count into the pool."""
        self.store.close(flush_s)

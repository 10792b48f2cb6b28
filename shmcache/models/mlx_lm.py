"""mlx-lm's KV-cache protocol over block tables of a shared pool.

An mlx-lm model touches its cache only through ``update_and_fetch(keys,
values)`` and ``offset`` (and ``make_mask`` for batches). The classes here
keep that protocol and add one thing: every K/V a model hands them is also
written through to the sequence's block table in the shared pool, where
every other process can find it once it is published.

* :class:`PoolSequence` is one sequence's block table: it finds the longest
  cached prefix (:meth:`PoolSequence.acquire`: the pool's L1, then its L2
  when the manager has one), reserves room (``prepare_append``:
  copy-on-write of a shared partial block, new blocks), stages each layer's
  new K/V, writes them through (:meth:`commit`, one ``append_kv`` per
  layer) and publishes full blocks (:meth:`publish`; with an L2, they are
  also queued for it).
* :class:`PoolKVCache` is mlx-lm's ``KVCache`` (one layer, one sequence)
  with the write-through: its working buffer is an MLX array in this
  process, so a step never re-reads the context from the pool; the pool is
  read once, when a cached prefix is loaded (:func:`load_prefix`).
* :class:`PoolBatchKVCache` is mlx-lm's ``BatchKVCache`` (left padding,
  per-row offsets, ``merge``/``filter``/``extend``/``extract``/
  ``prepare``/``finalize``) with one :class:`PoolSequence` per row.

NOTE: staged K/V are written at :meth:`PoolSequence.commit`, after the step
was evaluated, not inside ``update_and_fetch``: writing needs the values,
and evaluating there would serialise the graph layer by layer (and defeat
``mx.async_eval`` in mlx-lm's loops). A staged write is committed at the
latest by the next ``update_and_fetch`` of layer 0.

With an L2 tier on the manager (``mgr.l2``: ``shmcache.create_pool`` or
``shmcache.attach`` with ``l2=``), :meth:`PoolSequence.acquire` asks it for
the blocks after the L1 hit: they are loaded into fresh pool blocks and
published in L1 before anything is computed, so the prefill starts on a
block boundary as after an L1 hit, and the tokens are the same.

Models whose ``make_cache`` is not plain attention K/V for every layer
(sliding windows, SSM state, MLA with different K and V widths) are
refused by :func:`check_poolable` with the reason.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..shm import layout as L

__all__ = ["PoolSequence", "PoolKVCache", "PoolBatchKVCache", "pool_layout", "check_poolable",
           "make_pool_cache", "load_prefix", "NotPoolableError", "PendingSequence"]

log = logging.getLogger("shmcache.models.mlx_lm")


class NotPoolableError(ValueError):
    """The model's KV cache cannot live in a shmcache pool."""


_DTYPES = {getattr(mx, n): n for n in L.KV_DTYPES}     # MLX dtype -> a pool's dtype name


def check_poolable(model) -> None:
    """Raise :class:`NotPoolableError` unless every layer's cache is plain K/V."""
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
        odd = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
        if odd:
            raise NotPoolableError(
                f"this model's layers use {', '.join(odd)} caches (sliding window, recurrent "
                f"state or similar); shmcache pools only plain attention K/V (KVCache)")


def pool_layout(model) -> dict:
    """The pool layout a model needs: ``num_layers``, ``num_kv_heads``,
    ``head_dim`` and ``dtype``, read from the K/V of a one-token forward pass
    (so they are exactly what the model hands ``update_and_fetch``)."""
    check_poolable(model)
    caches = [KVCache() for _ in model.layers]
    model(mx.array([[0]]), cache=caches)
    k, v = caches[0].keys, caches[0].values
    mx.eval(k, v)
    if k.shape[-1] != v.shape[-1]:
        raise NotPoolableError(f"keys and values differ in width ({k.shape[-1]} vs "
                               f"{v.shape[-1]}, as in MLA); shmcache pools need one head_dim")
    if k.dtype not in _DTYPES:
        raise NotPoolableError(f"K/V dtype {k.dtype} is not one a pool stores")
    return dict(num_layers=len(caches), num_kv_heads=k.shape[1], head_dim=k.shape[-1],
                dtype=_DTYPES[k.dtype])


class PoolSequence:
    """One sequence's K/V in a pool: a block table and what is staged for it.

    Args:
        mgr: a ``PagedCacheManager`` attached to the pool (its ``l2``, if
            set, gets the blocks this sequence publishes).
        table: the sequence's ``BlockTable``; its token count is how many
            tokens the pool holds for it (cached prefix included).
        extra_keys: salt of the prefix chain (tenant), as ``cache_full_blocks`` takes.

    NOTE: ``stored`` counts the tokens whose K/V are written to the pool;
    ``reserved`` the tokens reserved by ``prepare_append`` and not yet
    stored. Blocks are published only up to ``stored``, so a published
    block's payload is always complete.
    """

    def __init__(self, mgr, table, extra_keys=None) -> None:
        self.mgr = mgr
        self.table = table
        self.extra_keys = extra_keys
        self.stored = table.num_tokens
        self.reserved = 0
        self.published = table.num_tokens // mgr.block_size
        self.ids: list = list(table.block_ids)   # a private copy, kept in step with the table
        self.chain: Optional[list] = None   # L2 chain hashes of the published blocks, if known
        self._staged: list = []        # (layer, keys (H, T, D), values (H, T, D))

    @classmethod
    def acquire(cls, mgr, request_id: str, tokens: Sequence[int],
                extra_keys=None) -> "PoolSequence":
        """A new sequence holding the longest cached prefix of ``tokens``.

        The prefix is whole blocks: the pool's own (one atomic lookup and
        reference), then, with an L2 (``mgr.l2``), the next blocks found
        there, loaded into new blocks and published in L1. An L2 fault or a
        pool too full to load into only makes the prefix shorter.

        Args:
            mgr: the manager.
            request_id: the new block table's id.
            tokens: the tokens whose K/V may come from a cache; pass a
                prompt without its last token, which must be computed for
                its logits.
            extra_keys: the tenant salt.
        Returns:
            The sequence; ``stored`` is the cached prefix's token count
            (what :func:`load_prefix` then reads).
        Raises:
            ValueError: the id is taken; what ``create_block_table`` raises.
        """
        return cls.begin(mgr, request_id, tokens, extra_keys).finish()

    @classmethod
    def begin(cls, mgr, request_id: str, tokens: Sequence[int],
              extra_keys=None) -> "PendingSequence":
        """:meth:`acquire` in two halves, for a caller that must not wait on
        L2: the L1 prefix is taken now and the L2 lookup of the next blocks
        starts on the L2's fetch thread; :meth:`PendingSequence.ready` says
        when :meth:`PendingSequence.finish` (which loads what arrived into
        the pool and returns the sequence) no longer waits: the lookup is
        done or its deadline (``--l2-timeout``) has passed.

        Raises:
            ValueError: the id is taken; what ``create_block_table`` raises.
        """
        table = mgr.create_block_table(request_id)
        try:
            bs = mgr.block_size
            _, cached = mgr.acquire_computed_blocks(tokens, extra_keys, table=table)
            l2 = getattr(mgr, "l2", None)
            chain = lookup = None
            if l2 is not None:
                n = len(tokens) // bs
                chain = l2.chain(tokens, n, extra_keys)
                if cached // bs < n:
                    lookup = l2.start(cached // bs, chain)
        except BaseException:
            mgr.delete_block_table(table.request_id)
            raise
        return PendingSequence(cls, mgr, table, tokens, extra_keys, cached // bs, chain, lookup)

    @classmethod
    def adopt(cls, mgr, source: str, request_id: str,
              extra_keys=None) -> Optional["PoolSequence"]:
        """A new sequence over a fork of the table ``source`` (any
        process's: a prefill another worker computed and keeps for this one),
        or None when that table no longer exists (its owner died or dropped
        it). Every block is shared, the partial last one too (copied on the
        first append); ``stored`` is the table's token count, and its full
        blocks are taken as published (the computing worker published them).
        """
        src = mgr.get_block_table(source)
        if src is None:
            return None
        try:
            table = mgr.fork_block_table(src, request_id)
        except KeyError:                 # dropped between the two calls
            return None
        return cls(mgr, table, extra_keys)

    def fork(self, request_id: str) -> "PoolSequence":
        """A sequence over a fork of this one's table (``fork_block_table``),
        same salt; everything staged must be committed first."""
        if self._staged:
            raise RuntimeError("commit() the staged K/V before forking")
        t = self.mgr.fork_block_table(self.table, request_id)
        other = type(self)(self.mgr, t, self.extra_keys)
        other.chain = list(self.chain) if self.chain is not None else None
        return other

    def reserve(self, n: int) -> None:
        """Room for ``n`` more tokens (raises OutOfBlocksError; nothing changes then)."""
        if n > self.reserved:
            first = (self.stored + self.reserved) // self.mgr.block_size
            got = self.mgr.prepare_append(self.table, n - self.reserved)
            # the blocks receiving the new tokens: the first may be a copy of
            # the previous last block (copy-on-write)
            self.ids[first:] = [b.block_id for b in got]
            self.reserved = n

    def stage(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Queue one layer's new K/V, (H, T, D), for :meth:`commit`."""
        self._staged.append((layer, keys, values))

    def commit(self) -> None:
        """Write the staged K/V to the pool (evaluating them if needed)."""
        if not self._staged:
            return
        n = self._staged[0][1].shape[1]
        bs, w = self.mgr.block_size, self.mgr.write_kv
        mx.eval([a for _, k, v in self._staged for a in (k, v)])
        for layer, k, v in self._staged:
            done = 0
            while done < n:                      # the span may cross blocks
                pos = self.stored + done
                m = min(bs - pos % bs, n - done)
                w(self.ids[pos // bs], layer, k[:, done:done + m], v[:, done:done + m], pos % bs)
                done += m
        self._staged.clear()
        self.stored += n
        self.reserved -= n

    def publish(self, tokens: Sequence[int]) -> int:
        """Publish the full blocks stored so far; with an L2 (``mgr.l2``),
        queue the newly published ones for it (never raises for that).

        Args:
            tokens: the sequence's token ids (at least ``stored`` of them).
        Returns:
            How many blocks are published.
        """
        bs = self.mgr.block_size
        full = self.stored // bs
        before = self.published
        if full > before:
            self.mgr.cache_full_blocks(self.ids[:full], list(tokens[:full * bs]), before, full,
                                       self.extra_keys)
            self.published = full
            l2 = getattr(self.mgr, "l2", None)
            if l2 is not None:
                self._write_back(l2, tokens, before, full)
        return self.published

    def _write_back(self, l2, tokens, before: int, full: int) -> None:
        try:
            self.chain = l2.chain(tokens, full, self.extra_keys, self.chain)
            l2.write_back(self.ids[before:full], self.chain[before:full])
        except Exception:              # never fail a sequence for its write-back
            log.exception("L2 write-back of %d blocks failed", full - before)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` stored tokens (and any reservation) from the
        table, releasing blocks left empty; returns how many were dropped."""
        self.commit()
        n = min(n, self.stored)
        if n or self.reserved:
            self.mgr.trim_table(self.table, n + self.reserved)
            self.stored -= n
            self.reserved = 0
            bs = self.mgr.block_size
            del self.ids[-(-self.stored // bs):]
            self.published = min(self.published, self.stored // bs)
            if self.chain is not None:
                del self.chain[self.published:]
        return n

    def release(self) -> None:
        """Commit nothing more; delete the table (its blocks go back to the
        pool, published ones stay cached)."""
        self._staged.clear()
        self.mgr.delete_block_table(self.table.request_id)


class PendingSequence:
    """A sequence whose L1 prefix is held and whose L2 lookup may be in
    flight (:meth:`PoolSequence.begin`).

    INVARIANT: the pool is touched on the owner's thread only; the fetch
    thread only reads Redis. What L2 delivered is written into fresh blocks
    and published in L1 by :meth:`finish`, before any prefill, so the
    prefill starts on a block boundary as after an L1 hit; what did not
    arrive by the deadline is computed.
    """

    def __init__(self, cls, mgr, table, tokens, extra_keys, first: int, chain, lookup) -> None:
        self._cls = cls
        self.mgr = mgr
        self.table = table
        self.tokens = tokens
        self.extra_keys = extra_keys
        self.first = first
        self.chain = chain
        self.lookup = lookup

    def ready(self) -> bool:
        """:meth:`finish` would not wait."""
        return self.lookup is None or self.lookup.ready()

    def finish(self) -> PoolSequence:
        """The sequence, with what L2 delivered loaded and published (waits
        for the lookup up to its deadline). An L2 fault or a pool too full
        to load into only makes the prefix shorter."""
        try:
            if self.lookup is not None:
                found = self.lookup.wait()
                self.lookup = None
                self.mgr.l2.install(self.table, self.tokens, self.extra_keys, self.first, found)
        except BaseException:
            self.release()
            raise
        seq = self._cls(self.mgr, self.table, self.extra_keys)
        if self.chain is not None:
            seq.chain = self.chain[:seq.published]
        return seq

    def release(self) -> None:
        """Give up: stop the lookup, delete the table (once)."""
        if self.table is None:
            return
        if self.lookup is not None:
            self.lookup.take()
            self.lookup = None
        table, self.table = self.table, None
        self.mgr.delete_block_table(table.request_id)


class PoolKVCache(KVCache):
    """mlx-lm's ``KVCache`` for one layer, written through to a :class:`PoolSequence`."""

    def __init__(self, seq: PoolSequence, layer: int) -> None:
        super().__init__()
        self.seq = seq
        self.layer = layer

    def update_and_fetch(self, keys, values):
        T = keys.shape[2]                      # keys: (1, H, T, D)
        if self.layer == 0:
            self.seq.commit()                  # the previous step's, if still staged
            self.seq.reserve(T)
        out = super().update_and_fetch(keys, values)
        self.seq.stage(self.layer, keys[0], values[0])
        return out

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = super().trim(n)
        if self.layer == 0:             # one table for every layer: trim it once
            self.seq.trim(n)
        return n


def make_pool_cache(model, seq: PoolSequence) -> List[PoolKVCache]:
    """One :class:`PoolKVCache` per layer of ``model``, over ``seq``."""
    return [PoolKVCache(seq, i) for i in range(len(model.layers))]


def load_prefix(caches: List[PoolKVCache]) -> int:
    """Read the tokens the sequence's table already holds (a cached prefix)
    from the pool into the working buffers, once. Returns their count."""
    seq = caches[0].seq
    n = seq.stored
    if n == 0:
        return 0
    ids = seq.table.block_ids
    for c in caches:
        k, v = seq.mgr.read_kv(ids, c.layer)              # (H, blocks*bs, D)
        c.keys = k[None, :, :n, :]                        # (1, H, T, D)
        c.values = v[None, :, :n, :]
        c.offset = n
    return n


class PoolBatchKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` for one layer, each row written through to
    its :class:`PoolSequence` (``seqs[i]`` is row i's; None: not pooled)."""

    def __init__(self, left_padding: List[int], seqs: Optional[list] = None, layer: int = 0) -> None:
        super().__init__(left_padding)
        self.seqs = list(seqs) if seqs is not None else [None] * len(left_padding)
        self.layer = layer
        self._real_end = None     # while right-padded: where each row's real tokens end

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        # NOTE: a right-padded prompt may come in several chunks (mlx-lm's
        # BatchGenerator cuts it at prefill_step_size): row i's real tokens
        # end at the start + its length, not at the end of every chunk.
        start = self._idx
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        self._real_end = None
        if self._right_padding is not None and lengths is not None:
            lengths = mx.array(lengths).tolist()
            lp = mx.array(left_padding).tolist() if left_padding is not None else [0] * len(lengths)
            self._real_end = [start + l + n for l, n in zip(lp, lengths)]

    def _real_tokens(self, T: int) -> List[int]:
        """How many of this chunk's T positions are real tokens, per row."""
        if T == 1 and self._right_padding is None:
            return [1] * len(self.seqs)
        lp: List[int] = self.left_padding.tolist()  # type: ignore[assignment]
        rp: List[int] = (self._right_padding.tolist()  # type: ignore[assignment]
                         if self._right_padding is not None else [0] * len(lp))
        start = self._idx
        if self._right_padding is not None and self._real_end is not None:
            return [max(0, min(T, e - start) - max(0, l - start))
                    for l, e in zip(lp, self._real_end)]
        return [max(0, T - max(0, l - start) - r) for l, r in zip(lp, rp)]

    def update_and_fetch(self, keys, values):
        T = keys.shape[2]                      # keys: (B, H, T, D)
        real = self._real_tokens(T)
        if self.layer == 0:
            for s, n in zip(self.seqs, real):
                if s is not None:
                    s.commit()
                    s.reserve(n)
        lp = self.left_padding.tolist() if T > 1 else None
        start = self._idx
        out = super().update_and_fetch(keys, values)
        for i, (s, n) in enumerate(zip(self.seqs, real)):
            if s is not None and n:
                a = max(0, lp[i] - start) if lp is not None else 0
                s.stage(self.layer, keys[i, :, a:a + n], values[i, :, a:a + n])
        return out

    def filter(self, batch_indices):
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        super().filter(batch_indices)
        self.seqs = [self.seqs[i] for i in idx]

    def extend(self, other):
        super().extend(other)
        self.seqs = self.seqs + list(getattr(other, "seqs", [None] * other.offset.shape[0]))

    def extract(self, idx):
        plain = super().extract(idx)
        c = PoolKVCache(self.seqs[idx], self.layer) if self.seqs[idx] is not None else KVCache()
        c.keys, c.values, c.offset = plain.keys, plain.values, plain.offset
        return c

    @classmethod
    def merge(cls, caches):
        plain = BatchKVCache.merge(caches)
        seqs = [getattr(c, "seq", None) for c in caches]
        layers = {c.layer for c in caches if hasattr(c, "layer")}
        out = cls([0] * len(caches), seqs, layers.pop() if len(layers) == 1 else 0)
        out.keys, out.values = plain.keys, plain.values
        out.offset, out.left_padding, out._idx = plain.offset, plain.left_padding, plain._idx
        return out

    def is_trimmable(self):
        return False

    def trim(self, n):
        return 0


def check_pool_matches(mgr, layout: dict) -> None:
    """Raise ``ValueError`` naming every field where the pool's layout differs
    from the model's (``pool_layout``): K/V are never cast silently."""
    lay = mgr.layout
    diff = [f"{k}: pool {getattr(lay, k)!r}, model {v!r}" for k, v in layout.items()
            if getattr(lay, k) != v]
    if diff:
        raise ValueError(f"pool {mgr.name!r} does not fit this model ({'; '.join(diff)})")

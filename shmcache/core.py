"""Shared internals of a manager: the primitive, lock-held steps every
public operation is built from, and the release paths recovery uses."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List

import numpy as np

from . import layout as L
from . import claims, recovery
from .blocks import CacheBlock, PoolStats, chain_hashes
from .errors import CapacityError
from .reclaim import reclaim_dead_slots, release_block
from .refs import rid_key
from .views import SharedBlock, SharedBlockTable

if TYPE_CHECKING:
    from .freelist import SharedFreeQueue
    from .holder import Holder
    from .index import OpenIndex, PrefixIndex
    from .lock import PoolLock
    from .pool import Pool
    from .refs import RefStore
    from .reserve import Reserves
    from .table_chains import TableChains

logger = logging.getLogger("shmcache.paged_cache")


class PoolOps:
    """Primitive steps over a pool; callers hold ``self._p.lock``.

    The state is owned by the collaborators the manager is built from
    (``paged_cache.PagedCacheManager.__init__``): the pool, this process's
    ``holder.Holder`` (references, epoch, table maps, cache_data), the free
    list, the prefix index, the table index and the reserves.
    """

    name: str
    block_size: int
    max_blocks: int
    enable_caching: bool
    _p: "Pool"
    _h: "Holder"
    _fq: "SharedFreeQueue"
    _index: "PrefixIndex"
    _tindex: "OpenIndex"
    _lock: "PoolLock"
    _root: bytes
    _reserves: "Reserves"

    if TYPE_CHECKING:      # the facade's own (paged_cache.PagedCacheManager)
        @property
        def free_blocks(self) -> int: ...

        def get_new_blocks(self, num_blocks: int) -> List[CacheBlock]: ...

    # this process's holding, owned by the holder (names kept for callers)
    @property
    def _refs(self) -> "RefStore":
        return self._h.refs

    @property
    def _epoch(self) -> int:
        return self._h.epoch

    @property
    def _tcache(self) -> dict:
        return self._h.tcache

    @property
    def _chains(self) -> "TableChains":
        return self._h.chains

    # ================================================================ internals
    def _bid(self, block) -> int:
        if type(block) is int and 0 <= block < self.max_blocks:
            return block
        b = block.block_id if isinstance(block, CacheBlock) else block
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise TypeError(f"block id must be an int, got {type(b).__name__}")
        b = int(b)
        if not 0 <= b < self.max_blocks:
            raise ValueError(f"block id {b} out of range [0, {self.max_blocks})")
        return b

    def _bids(self, blocks) -> list:
        out = []
        n = self.max_blocks
        for b in blocks:
            if type(b) is SharedBlock and b._m is self:
                out.append(b._id)
            elif type(b) is int and 0 <= b < n:
                out.append(b)
            else:
                out.append(self._bid(b))
        return out

    def _sync(self) -> None:
        # (the lock has checked that this manager is usable)
        self._h.sync()

    def _set_block_hash(self, b: int, h) -> None:
        with self._p.lock:
            b = self._bid(b)
            if b == 0:
                raise ValueError("the null block cannot be cached")
            if h is not None and (not isinstance(h, (bytes, bytearray)) or len(h) != L.HASH_BYTES):
                raise ValueError(f"block_hash must be {L.HASH_BYTES} bytes, got {h!r}")
            if h is not None and not self.enable_caching:
                return
            if self._p.b_flags[b] & L.FLAG_CACHED:
                self._index.remove(b)
            if h is not None:
                self._index.add(b, bytes(h))

    def _set_ref_count(self, b: int, v) -> None:
        if type(v) is int and v == self._p.b_ref[b]:
            return          # (the seed's own allocation sets it to what it is)
        raise AttributeError(
            "ref_count of a shared block follows the references held; use "
            "touch/increment_ref/free_block (block %d)" % b)

    def _set_token_count(self, b: int, v) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.block_size:
            raise ValueError(f"token_count must be an int in [0, {self.block_size}], got {v!r}")
        self._p.b_tok[b] = v

    # cache_data: owned by the holder (holder.Holder.block_payload)
    def _block_payload(self, b: int):
        return self._h.block_payload(b)

    def _set_block_payload(self, b: int, data) -> None:
        self._h.set_block_payload(b, data)

    def _drop_payloads(self, blocks=None) -> None:
        self._h.drop_payloads(blocks)

    def _copy_payload(self, old: int, new: int) -> None:
        self._h.copy_payload(old, new)

    def _scan_stats(self) -> PoolStats:
        with self._p.lock:
            s = recovery.scan_stats(self._p)
            c = self._p.c
            return PoolStats(s["total_blocks"], s["allocated_blocks"], s["free_blocks"],
                             s["shared_blocks"], s["total_tokens_cached"], c[L.C_HITS],
                             c[L.C_MISSES], c[L.C_COW], c[L.C_EVICTIONS],
                             **{k: s[k] for k in PoolStats.CAPACITY})

    def _pop_free(self) -> int:
        p = self._p
        b = self._fq.popleft_id()
        if p.b_flags[b] & L.FLAG_CACHED:
            self._index.remove(b)
            p.c[L.C_EVICTIONS] += 1
        p.b_ref[b] = 1
        p.b_tok[b] = 0
        p.b_last[b] = p.now()
        p.b_gen[b] = (p.b_gen[b] + 1) & 0xFFFFFFFF     # a new life: old cache_data is void
        return b

    def _ensure_free(self, n: int) -> bool:
        free = self._p.c[L.C_NUM_FREE]
        if not 0 <= free < self.max_blocks:
            raise self._p.corrupt(f"the free-block counter is {free}, outside "
                                  f"[0, {self.max_blocks})")
        if free >= n:
            return True
        self._reclaim_locked()
        free = self._p.c[L.C_NUM_FREE]
        if free < n:
            self._reserves.take_from_reserves(n - free)
        return self._p.c[L.C_NUM_FREE] >= n

    def _take_ref(self, b: int) -> None:
        """One more reference on ``b``, held loose by this manager."""
        self._count_ref(b)
        self._refs.add_loose(b)

    def _count_ref(self, b: int) -> None:
        """One more reference counted on ``b`` (a free one taken out of the
        free list, a reserved one out of its reserve first); the caller
        names it in a list of this manager's (loose, or a table's)."""
        p = self._p
        if p.b_prev[b] <= -2:
            self._reserves.take_block(b)     # (free now, if a reserve held it)
        if p.b_ref[b] == 0:
            if p.b_prev[b] < 0 or p.b_next[b] < 0:
                raise p.corrupt(f"block {b} has no references but is not in the free list")
            self._fq.remove_id(b)
        p.b_ref[b] += 1
        p.b_last[b] = p.now()

    def _release(self, b: int) -> bool:
        release_block(self._p, self._fq, b)
        return self._p.b_ref[b] == 0

    def _hashes(self, token_ids, n_blocks: int, extra_keys, parent=None, start=0) -> list:
        return chain_hashes(self._root, self.block_size, token_ids, n_blocks, extra_keys,
                            parent, start)

    def _table_index(self, table) -> int:
        p = self._p
        if isinstance(table, SharedBlockTable) and table._m._p is p:
            t = table._t
            if p.t_state[t] == 1 and p.t_rhash[t] == table._rh:
                return self._checked_table(t)
            raise KeyError(f"block table {table.request_id!r} no longer exists")
        rid = getattr(table, "request_id", table)
        raw, h = rid_key(rid)
        t = self._tindex.find(raw, h)
        if t < 0:
            raise KeyError(f"no block table for request {rid!r}")
        return self._checked_table(t)

    def _checked_table(self, t: int) -> int:
        # the fields every table operation indexes with, checked once here;
        # in a hold, the table's claim taken first (claims.py: its owner may
        # be appending without the lock)
        p = self._p
        if p.lock.held:
            claims.claim(p, t)
        nch = p.layout.num_chunks
        if not (-1 <= p.t_head[t] < nch and -1 <= p.t_tail[t] < nch
                and 0 <= p.t_len[t] <= nch * L.CHUNK_IDS and p.t_tok[t] >= 0):
            raise p.corrupt(f"table {t}: head {p.t_head[t]}, tail {p.t_tail[t]}, length "
                            f"{p.t_len[t]}, tokens {p.t_tok[t]} do not describe a list")
        return t

    def _rid_of(self, t: int) -> str:
        raw = bytes(self._p.tables["request_id"][t])
        try:
            rid = raw.decode()
            if rid_key(rid)[1] == int(self._p.tables["rid_hash"][t]):
                return rid
        except (TypeError, ValueError):         # (UnicodeDecodeError is a ValueError)
            pass
        raise self._p.corrupt(f"table {t}: request id {raw!r} does not match its hash")

    def _table_view(self, t: int) -> SharedBlockTable:
        p = self._p
        return SharedBlockTable(self, t, self._rid_of(t), int(p.tables["rid_hash"][t]))

    def _table_ids(self) -> list:
        with self._p.lock:
            st = self._p.tables
            return [self._rid_of(t) for t in np.flatnonzero(st["state"] == 1).tolist()]

    def _new_table(self, request_id: str, key=None) -> int:
        p = self._p
        raw, h = key or rid_key(request_id)
        if self._tindex.find(raw, h) >= 0:
            raise ValueError(f"a block table for request {request_id!r} already exists")
        # (a free record whose claim is not 0 is skipped, as hot_table_new does)
        free = np.flatnonzero((p.tables["state"] == 0) & (p.tables["claim"] == 0))
        if not free.size:
            raise CapacityError(f"pool {self.name!r} has no free block table "
                                f"(max_tables={p.layout.max_tables})")
        t = int(free[0])
        rec = p.tables[t]
        rec["request_id"] = raw
        rec["rid_hash"] = h
        rec["owner"] = p.slot
        rec["head"] = rec["tail"] = -1
        rec["length"] = rec["num_tokens"] = 0
        self._tindex.insert(t, h)
        p.t_state[t] = 1           # commit
        p.c[L.C_NUM_TABLES] += 1
        self._tcache[t] = (h, None, {})
        self._chains.forget(t)
        return t

    def _holds(self, b: int) -> bool:
        """Whether this manager holds a reference to block ``b`` (lock held):
        ``holder.Holder.holds``."""
        return self._h.holds(b)

    def _holds_fast(self, b: int) -> bool:
        """``_holds`` without the lock (False means "ask ``_holds``")."""
        return self._h.holds_fast(b)

    def _table_add(self, table, block, tokens_in_block: int, set_block_tokens=True,
                   count_tokens=False) -> None:
        with self._p.lock:
            self._sync()
            t = self._table_index(table)
            b = self._bid(block)
            if isinstance(tokens_in_block, bool) or not isinstance(tokens_in_block, int) \
                    or not 0 <= tokens_in_block <= self.block_size:
                raise ValueError(f"tokens_in_block must be an int in [0, {self.block_size}], "
                                 f"got {tokens_in_block!r}")
            self._table_put(t, [b])
            p = self._p
            if set_block_tokens:
                p.b_tok[b] = tokens_in_block
            p.t_tok[t] += tokens_in_block
            if count_tokens:
                p.add_tokens(tokens_in_block)      # as the seed's add_block_to_table

    def _table_edit(self, table, op):
        """Apply ``op`` (a list mutation) to the table's block ids, moving
        references as ``views.TableBlockIds`` says; returns (the table's ids
        now, what ``op`` returned). Nothing changes when ``op`` raises, an id
        is bad, or the references do not fit."""
        with self._p.lock:
            self._sync()
            p, refs = self._p, self._refs
            t = self._table_index(table)
            cur = refs.table_blocks(t)
            new = list(cur)
            result = op(new)
            if new == cur:                  # (the common case: a caller's copy kept in step)
                return cur, result
            new = self._bids(new)
            if 0 in new:
                raise ValueError("the null block (block 0) cannot be put in a block table")
            have: dict = {}
            for b in cur:
                have[b] = have.get(b, 0) + 1
            added: list = []
            for b in new:
                if have.get(b, 0):
                    have[b] -= 1
                else:
                    added.append(b)
            removed = [b for b, k in have.items() for _ in range(k)]
            avail = {b: refs.loose.count(b) for b in added}
            fresh = 0
            for b in added:
                if avail[b]:
                    avail[b] -= 1
                else:
                    fresh += 1
            refs.need_chunks(refs.table_chunks_needed(t, max(0, len(new) - len(cur)))
                             + refs.loose_chunks_needed(fresh + len(removed)))
            avail = {b: refs.loose.count(b) for b in added}
            for b in added:
                if avail[b]:
                    avail[b] -= 1
                else:
                    self._take_ref(b)
            # write: ids in place where both have a position, then grow or cut
            # (NOTE: each write is its own commit; a holder dying midway
            # leaves the table part changed, every reference still counted)
            k = min(len(cur), len(new))
            diff = [i for i in range(k) if cur[i] != new[i]]
            if diff:
                words = refs.table_words(t)
                for i in diff:
                    p.kw[words[i]] = new[i]
            if len(new) > len(cur):
                refs.table_extend(t, new[len(cur):])
            elif len(new) < len(cur):
                refs.table_truncate(t, len(new))
            for b in added:
                refs.drop_loose(b)
            for b in removed:
                refs.add_loose(b)
            if len(new) > len(cur) and new[:len(cur)] == cur:
                self._chains.last_add = (t, len(new) - 1, new[-1])
            else:
                self._chains.cut(t, next((i for i, (a, b) in enumerate(zip(cur, new)) if a != b),
                                         min(len(cur), len(new))))
            return new, result

    def _table_put(self, t: int, ids: list) -> None:
        """Append block ids to table ``t``, each id one reference: one this
        manager holds outside its tables moves into the table, or, where it
        holds none, a new one is taken (as ``touch`` takes one).

        NOTE: a new reference is counted, then the table's list names it
        (as acquire_computed_blocks's table branch, and _hot.add_block, do:
        no detour through the loose list); a holder dying in between leaves
        a count above the lists, which repair recomputes from them. A moved
        one is named by the table, then dropped from the loose list.

        Raises:
            ValueError: the null block. CapacityError: no room for the
                references (nothing changed).
        """
        if 0 in ids:
            raise ValueError("the null block (block 0) cannot be put in a block table")
        refs = self._refs
        moved: dict = {}
        for b in ids:
            moved[b] = moved.get(b, 0) + 1
        avail = {b: refs.loose.count(b) for b in moved}
        refs.need_chunks(refs.table_chunks_needed(t, len(ids)))
        start = int(self._p.t_len[t])
        move = []
        for b in ids:
            if avail[b] > 0:
                avail[b] -= 1
                move.append(b)
            else:
                self._count_ref(b)
        refs.table_extend(t, ids)
        for b in move:
            refs.drop_loose(b)
        if ids:
            self._chains.last_add = (t, start + len(ids) - 1, ids[-1])

    def _reclaim_locked(self) -> int:
        return reclaim_dead_slots(self._p, self._refs)


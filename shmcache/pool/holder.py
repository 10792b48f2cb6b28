"""``Holder``: what this process holds in a pool, and its process-local
knowledge of it.

One per manager. It owns:

- ``refs``: this process's references (``refs.RefStore``: its slot's loose
  list in the chunk area and the local loose map, ``loosemap.LooseMap``);
- ``epoch``: the pool's epoch counter as it was when the loose map was last
  read. The map is current while the two are equal (``sync`` re-reads it
  otherwise); the C hot paths are passed it and refuse a stale view;
- ``tcache``: the maps of the tables this process created (``holds``);
- ``chains``: where appended blocks sit in their prefix chains
  (``table_chains.TableChains``);
- the seed's per-block ``cache_data`` objects, kept for this process only
  and keyed by the block's generation (``block_payload``).

Invariant: ``epoch`` only moves forward to the pool's value, and only when
the loose map was re-read (``sync``) or is known to be unchanged
(``bump_epoch``: another slot's list moved, not this one's).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..shm import layout as L
from ..shm.refs import RefStore
from ..shm.table_chains import TableChains


class Holder:
    """This process's holding in ``pool`` (see the module docstring)."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.refs = RefStore(pool)
        self.epoch: int = pool.counters.epoch
        # table -> (rid hash, (head, tail, length) when read, {block: word})
        self.tcache: Dict[int, Tuple[int, Optional[tuple], dict]] = {}
        self.chains = TableChains()
        self.cdata: Dict[int, Tuple[int, Any]] = {}     # block -> (generation, cache_data)
        self.cdata_prune = 64

    @property
    def slot(self) -> int:
        return self.pool.slot

    # ================================================================ the epoch
    def current(self) -> bool:
        """Whether the loose map is current (read without the lock)."""
        return self.epoch == self.pool.counters.epoch

    def sync(self) -> None:
        """Re-read the loose map if another process moved this slot's list
        (lock held; the lock has checked that the pool is usable)."""
        p = self.pool
        epoch = p.counters.epoch
        if epoch != self.epoch:
            self.refs.resync()
            self.epoch = epoch

    def bump_epoch(self) -> None:
        """Tell every other holder to re-read its map (lock held): another
        slot's list moved. This holder's own map is still current."""
        p = self.pool
        self.epoch = p.counters.bump_epoch()

    # ========================================================= loose references
    def loose_held(self, b: int) -> int:
        """Loose references held on ``b``, less the one of a block in this
        process's reserve (that one is free)."""
        p = self.pool
        return self.refs.loose.count(b) - int(p.b_prev[b] == L.stash_mark(p.slot))

    def holds(self, b: int) -> bool:
        """Whether this process holds a reference to block ``b`` (lock held):
        a loose one, or one in a table it owns.

        Tables are looked at through ``tcache``: a table's map is re-read
        when its list changed, and a word found is re-checked. A block
        found in no map is looked for once more in maps all read afresh (a
        copy-on-write rewrites an id in place).
        """
        if self.refs.loose.count(b):
            return True
        return self.in_own_table(b, 1) or self.in_own_table(b, 2)

    def holds_fast(self, b: int) -> bool:
        """``holds`` without the lock, from what is known already: True only
        for a loose reference or a table map that is still current (False
        means "ask ``holds``")."""
        return self.current() and (self.refs.loose.count(b) > 0 or self.in_own_table(b, 0))

    def in_own_table(self, b: int, read: int) -> bool:
        """Whether ``b`` is in a table this process owns; ``read``: 0 maps
        as they are (a changed table is skipped), 1 re-read the changed
        ones, 2 re-read all."""
        p = self.pool
        st, ow, rh = p.t_state, p.t_owner, p.t_rhash
        cache = self.tcache
        for t in list(cache):
            entry = cache.get(t)        # (another thread may drop it meanwhile)
            if entry is None:
                continue
            h, key, recs = entry
            if st[t] != 1 or ow[t] != p.slot or rh[t] != h:
                if read:
                    cache.pop(t, None)
                continue
            cur = (p.t_head[t], p.t_tail[t], p.t_len[t])
            if read == 2 or cur != key:
                if not read:
                    continue
                words = self.refs.table_words(t)
                kw = p.kw
                recs = {kw[g]: g for g in words}
                cache[t] = (h, cur, recs)
            g = recs.get(b)
            if g is not None and p.kw[g] == b:
                return True
        return False

    # ================================================================ cache_data
    # cache_data: the seed's per-block Python object (its KV tensors, in any
    # form its caller chose). It lives here, for this process (another
    # process has its own objects; the pool's payload is what write_kv/read_kv
    # share), keyed by block and the block's generation: once the block is
    # taken for reuse by any process, the object is gone.
    def block_payload(self, b: int):
        e = self.cdata.get(b)
        if e is None:
            return None
        if e[0] != self.pool.b_gen[b]:
            self.cdata.pop(b, None)
            return None
        return e[1]

    def set_block_payload(self, b: int, data) -> None:
        cd = self.cdata
        if data is None:
            cd.pop(b, None)
            return
        cd[b] = (self.pool.b_gen[b], data)
        if len(cd) > self.cdata_prune:
            gen = self.pool.b_gen
            for k in [k for k, e in cd.items() if e[0] != gen[k]]:
                del cd[k]
            self.cdata_prune = max(64, 2 * len(cd))

    def drop_payloads(self, blocks=None) -> None:
        if blocks is None:
            self.cdata.clear()
        else:
            for b in blocks:
                self.cdata.pop(b, None)

    def copy_payload(self, old: int, new: int) -> None:
        """Copy-on-write: the copy has the source's object, as in the seed."""
        data = self.block_payload(old)
        if data is not None:
            self.cdata[new] = (self.pool.b_gen[new], data)

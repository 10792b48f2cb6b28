"""Live views of shared records, shaped like the seed's objects.

A view holds only (manager, id): every attribute read or write goes to
shared memory, so two processes looking at block 7 see the same thing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..shm.blocks import BlockTable, CacheBlock
from ..shm.layout import FLAG_NULL


class SharedBlock(CacheBlock):
    """A ``CacheBlock`` that is a live view of block ``block_id`` of a pool.

    ``ledger`` is the ``core.BlockLedger`` it reads and writes through
    (the pool's records, this process's cache_data and checks).
    """

    def __init__(self, ledger, block_id: int) -> None:  # (super().__init__ not called on purpose)
        self.ledger = ledger
        self._id = block_id

    block_id = property(lambda self: self._id)

    @property
    def ref_count(self) -> int:
        return self.ledger.pool.b_ref[self._id]

    @ref_count.setter
    def ref_count(self, v: int) -> None:
        self.ledger.set_ref_count(self._id, v)

    @property
    def token_count(self) -> int:
        return self.ledger.pool.b_tok[self._id]

    @token_count.setter
    def token_count(self, v: int) -> None:
        self.ledger.set_token_count(self._id, v)

    @property
    def block_hash(self):
        return self.ledger.index.hash_of(self._id)

    @block_hash.setter
    def block_hash(self, v) -> None:
        self.ledger.set_block_hash(self._id, v)

    @property
    def hash_value(self):
        h = self.ledger.index.hash_of(self._id)
        return h.hex() if h is not None else None

    @hash_value.setter
    def hash_value(self, v) -> None:
        if v is None:
            self.ledger.set_block_hash(self._id, None)

    @property
    def last_access(self) -> float:
        return self.ledger.pool.created_at + self.ledger.pool.b_last[self._id]

    @last_access.setter
    def last_access(self, v: float) -> None:
        self.ledger.pool.b_last[self._id] = v - self.ledger.pool.created_at

    @property
    def is_null(self) -> bool:
        return bool(self.ledger.pool.b_flags[self._id] & FLAG_NULL)

    @is_null.setter
    def is_null(self, v) -> None:
        if bool(v) != self.is_null:
            raise AttributeError("the null block of a pool is fixed at block 0")

    def _neighbour(self, b: int):
        p = self.ledger.pool
        if b < 0:
            return None
        if b >= p.layout.max_blocks:
            return CacheBlock(block_id=-1 if b == p.HEAD else -2)
        return SharedBlock(self.ledger, b)

    prev_free_block = property(lambda self: self._neighbour(self.ledger.pool.b_prev[self._id]))
    next_free_block = property(lambda self: self._neighbour(self.ledger.pool.b_next[self._id]))

    @property
    def cache_data(self):
        return self.ledger.block_payload(self._id)

    @cache_data.setter
    def cache_data(self, v) -> None:
        self.ledger.set_block_payload(self._id, v)

    def touch(self) -> None:
        self.ledger.pool.b_last[self._id] = self.ledger.pool.now()

    def reset_hash(self) -> None:
        self.ledger.set_block_hash(self._id, None)

    def __eq__(self, other) -> bool:
        if isinstance(other, SharedBlock):
            return self.ledger.pool is other.ledger.pool and self._id == other._id
        return NotImplemented

    def __hash__(self) -> int:
        return hash((id(self.ledger.pool), self._id))


def _mutator(name):
    def method(self, *args):
        return self._edit(lambda ids: getattr(list, name)(ids, *args))
    method.__name__ = name
    method.__doc__ = f"list.{name}, applied to the table (see TableBlockIds)."
    return method


class TableBlockIds(list):
    """``block_ids`` of a live table: a list of the table's block ids, read
    from the pool, whose mutations change the table.

    A mutation (``append``, ``extend``, ``pop``, ``insert``, ``remove``,
    ``clear``, item and slice assignment or deletion, ``+=``, ``sort``,
    ``reverse``) is applied, under the pool lock, to the table's ids as they
    are then (so also when this list was read before another change), and
    the list then holds the table's ids again. Every id in a table is a
    reference: an id added moves into the table a reference this manager
    holds outside its tables (as ``allocate_block``, ``increment_ref`` or
    ``touch`` give), or takes a new one where it holds none; an id taken out
    moves its reference to this manager (``free_block`` drops it), as the
    seed's ``delete_block_table`` would have freed it. ``num_tokens`` is not
    changed (the seed's callers set it). Reading is a plain list's.

    Copies (slices, ``copy()``, ``list(...)``, pickles) are plain lists.
    """

    __slots__ = ("_tv",)

    def __init__(self, tv, ids) -> None:
        list.__init__(self, ids)
        self._tv = tv

    def _edit(self, op):
        ids, result = self._tv.edit_ids(op)
        list.__setitem__(self, slice(None), ids)
        return result

    append = _mutator("append")
    extend = _mutator("extend")
    insert = _mutator("insert")
    remove = _mutator("remove")
    clear = _mutator("clear")
    reverse = _mutator("reverse")
    __setitem__ = _mutator("__setitem__")
    __delitem__ = _mutator("__delitem__")

    def pop(self, index=-1):
        return self._edit(lambda ids: ids.pop(index))

    def sort(self, *, key=None, reverse=False):
        return self._edit(lambda ids: ids.sort(key=key, reverse=reverse))

    def __iadd__(self, other):  # type: ignore[misc]  # (list's: the table's ids, changed)
        other = list(other)
        self._edit(lambda ids: ids.extend(other))
        return self

    def __imul__(self, n):  # type: ignore[misc]
        self._edit(lambda ids: ids.__imul__(n))
        return self

    def __reduce__(self):
        return (list, (list(self),))

    def __copy__(self):
        return list(self)

    def __deepcopy__(self, memo):
        return list(self)


class TableRecord(NamedTuple):
    """Where a ``SharedBlockTable`` lives in its pool (``SharedBlockTable.
    internals``): not API."""
    table: int      # the table's record: its index in the pool's table array (``pool.tables``)
    rid_hash: int   # its request id's hash: the record is this table while they match


class SharedBlockTable(BlockTable):
    """A ``BlockTable`` that is a live view of a table in shared memory.

    ``block_ids`` is a ``TableBlockIds`` read from the pool on each access:
    its mutations change the table.
    """

    # (set once in __init__, past the dataclass's own fields)
    _m: Any         # the tables.BlockTables whose table this is
    _t: int         # the table's record
    _rid: str
    _rh: int        # the request id's hash: the record is this table while it matches

    def __init__(self, tables, t: int, request_id: str, rid_hash: int) -> None:  # noqa
        object.__setattr__(self, "_m", tables)
        object.__setattr__(self, "_t", t)
        object.__setattr__(self, "_rid", request_id)
        object.__setattr__(self, "_rh", rid_hash)

    request_id = property(lambda self: self._rid)

    @property
    def internals(self) -> TableRecord:
        """The internal seam for tests and tools (not API, no stability
        promised), as ``PagedCacheManager.internals`` is: the table's record
        and its request id's hash, the arguments the C table operations take
        (``pool.ops.table_ids(rec.table, rec.rid_hash, slot, epoch)``).
        Code in shmcache/ uses ``record_in`` instead."""
        return TableRecord(self._t, self._rh)

    def record_in(self, pool):
        """``(table record, request id hash)`` if this is a view of a table
        of ``pool`` (the record is the table while the hash matches), else None."""
        return (self._t, self._rh) if self._m.pool is pool else None

    def edit_ids(self, op):
        """Apply ``op`` to the table's block ids (``BlockTables.table_edit``)."""
        return self._m.table_edit(self, op)

    @property
    def block_ids(self) -> list:  # type: ignore[override]  # (the dataclass field, live)
        m = self._m
        p = m.pool
        fused = p.ops.table_ids
        # C (_hot.table_ids): the read under the table's claim with no lock,
        # or in a hold of the C call's own, never one that runs Python (the
        # serving path reads it once a request); None: the path below reads
        # it, or says what is wrong
        if not p.lock.unusable and not p.lock.held:
            ids = fused(self._t, self._rh, p.slot, m.holder.epoch)
            if ids is not None:
                return TableBlockIds(self, ids)
        with p.lock:
            return TableBlockIds(self, m.holder.refs.table_blocks(m.table_index(self)))

    @property
    def num_tokens(self) -> int:
        return self._m.pool.t_tok[self._m.table_index(self)]

    @num_tokens.setter
    def num_tokens(self, v: int) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {v!r}")
        with self._m.pool.lock:
            self._m.pool.t_tok[self._m.table_index(self)] = int(v)

    @property
    def owner_slot(self) -> int:
        return self._m.pool.t_owner[self._m.table_index(self)]

    def add_block(self, block_id: int, num_tokens: int) -> None:
        self._m.table_add(self, block_id, num_tokens, set_block_tokens=False)

    def __len__(self) -> int:
        return self._m.pool.t_len[self._m.table_index(self)]

    def copy(self, new_request_id: str) -> BlockTable:
        return BlockTable(new_request_id, list(self.block_ids), self.num_tokens)

    def __eq__(self, other) -> bool:
        if isinstance(other, SharedBlockTable):
            return self._m.pool is other._m.pool and self._t == other._t and self._rh == other._rh
        return NotImplemented

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        try:
            return (f"SharedBlockTable(request_id={self._rid!r}, "
                    f"block_ids={self.block_ids}, num_tokens={self.num_tokens})")
        except KeyError:
            return f"SharedBlockTable(request_id={self._rid!r}, deleted)"

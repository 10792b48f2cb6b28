"""check(): clean after real scenarios, and detecting each kind of corruption
of the shared state (blocks, free list, reference chunks, tables, indexes)."""

from __future__ import annotations

import numpy as np
import pytest

from shmcache.shm import layout as L

from _helpers import cached_table

# ====================================================================== check()
def _scenario(m):
    t, ids, tokens = cached_table(m, "a", 3)
    f = m.fork_block_table(t, "b")
    m.prepare_append(f, 2)
    got, _ = m.acquire_computed_blocks(tokens)
    m.get_new_blocks(2)
    m.create_block_table("empty")
    # a table of two chunks (18 references to three blocks)
    m.fork_block_table(t, "long").block_ids.extend(ids * 5)
    return t, ids, got


def test_check_empty_after_scenarios(manager):
    assert manager.check() == []
    _scenario(manager)
    assert manager.check() == []
    manager.delete_block_table("a")
    assert manager.check() == []
    manager.evict_lru_blocks(10)
    assert manager.check() == []


CORRUPTIONS = {
    "ref_count": lambda m, p: p.b_ref.__setitem__(5, 7),
    "null ref": lambda m, p: p.b_ref.__setitem__(0, 2),
    "null flag": lambda m, p: p.b_flags.__setitem__(0, 0),
    "second null": lambda m, p: p.b_flags.__setitem__(20, p.b_flags[20] | L.FLAG_NULL),
    "next link": lambda m, p: p.b_next.__setitem__(m.free_block_queue.ids()[2],
                                                   m.free_block_queue.ids()[4]),
    "prev link": lambda m, p: p.b_prev.__setitem__(m.free_block_queue.ids()[3], p.HEAD),
    "tail prev": lambda m, p: p.b_prev.__setitem__(p.TAIL, p.HEAD),
    "next out of range": lambda m, p: p.b_next.__setitem__(m.free_block_queue.ids()[1], 9999),
    "free counter": lambda m, p: p.c.__setitem__(L.C_NUM_FREE, p.c[L.C_NUM_FREE] + 1),
    "held block keeps links": lambda m, p: p.b_next.__setitem__(
        m.request_tables["a"].block_ids[0], 3),
    "free block unlinked": lambda m, p: _unlink_first(p),
    "cached flag without index": lambda m, p: p.b_flags.__setitem__(
        m.free_block_queue.ids()[0], p.b_flags[m.free_block_queue.ids()[0]] | L.FLAG_CACHED),
    "index entry dropped": lambda m, p: p.hidx.__setitem__(
        int(np.flatnonzero(p.hidx >= 0)[0]), -1),
    "hash bytes changed": lambda m, p: _flip_hash(m, p),
    "table index dropped": lambda m, p: p.tidx.__setitem__(
        int(np.flatnonzero(p.tidx >= 0)[0]), -1),
    "table counter": lambda m, p: p.c.__setitem__(L.C_NUM_TABLES, p.c[L.C_NUM_TABLES] + 1),
    "table length": lambda m, p: p.t_len.__setitem__(_live_table(p), p.t_len[_live_table(p)] + 1),
    "table tail": lambda m, p: p.t_tail.__setitem__(_table(m, "long"), p.t_head[_table(m, "long")]),
    "table tokens": lambda m, p: p.t_tok.__setitem__(
        _table(m, "a"), p.t_len[_table(m, "a")] * m.block_size + 1),
    "loose count": lambda m, p: p.s_count.__setitem__(p.slot, p.s_count[p.slot] + 1),
    "chunk off every list": lambda m, p: _leak_chunk(p),
    "free chunk holds a block": lambda m, p: p.kw.__setitem__(
        p.c[L.C_FREE_REF] * L.CHUNK_WORDS + 1, 3),
    "free chunk counter": lambda m, p: p.c.__setitem__(L.C_FREE_REFS, p.c[L.C_FREE_REFS] - 1),
    "chunk in two lists": lambda m, p: p.t_head.__setitem__(_table(m, "b"), p.t_head[_table(m, "a")]),
    "cyclic table list": lambda m, p: p.kw.__setitem__(
        p.t_head[_table(m, "long")] * L.CHUNK_WORDS, p.t_head[_table(m, "long")]),
    "chain past its end": lambda m, p: p.kw.__setitem__(
        p.t_tail[_table(m, "a")] * L.CHUNK_WORDS, p.c[L.C_FREE_REF]),
    "table names no block": lambda m, p: p.kw.__setitem__(
        p.t_head[_table(m, "a")] * L.CHUNK_WORDS + 2, 10**6),
    "cached null": lambda m, p: p.b_flags.__setitem__(0, L.FLAG_NULL | L.FLAG_CACHED),
}


def _unlink_first(p):
    b = p.b_next[p.HEAD]
    n = p.b_next[b]
    p.b_next[p.HEAD] = n
    p.b_prev[n] = p.HEAD
    p.b_prev[b] = p.b_next[b] = -1
    p.c[L.C_NUM_FREE] -= 1


def _flip_hash(m, p):
    e = int(p.hidx[np.flatnonzero(p.hidx >= 0)[0]])
    off = p.layout.blocks_off + e * L.BLOCK_DTYPE.itemsize + L.BLOCK_HASH_OFF
    p.raw[off] ^= 0xFF


def _live_table(p):
    live = np.flatnonzero((p.tables["state"] == 1) & (p.tables["length"] > 0))
    return int(live[0])


def _table(m, rid):
    return m.internals.tables.table_index(rid)


def _leak_chunk(p):
    c = p.c[L.C_FREE_REF]
    p.c[L.C_FREE_REF] = p.kw[c * L.CHUNK_WORDS]
    p.kw[c * L.CHUNK_WORDS] = -1


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_check_detects_corruption(manager, kind):
    _scenario(manager)
    assert manager.check() == []
    p = manager.pool
    raw_before = bytes(p.mm[:p.layout.arena_off])
    CORRUPTIONS[kind](manager, p)
    assert bytes(p.mm[:p.layout.arena_off]) != raw_before, "the corruption changed nothing"
    problems = manager.check()
    assert problems, f"check() missed: {kind}"
    assert all(isinstance(s, str) and s for s in problems)
    # check() only reads: running it again reports the same
    assert manager.check() == problems


def test_check_detects_ref_count_example(manager):
    manager.get_new_blocks(6)
    manager.pool.b_ref[5] = 7
    problems = manager.check()
    assert any("block 5" in s and "ref_count" in s for s in problems)
    manager.pool.b_ref[5] = 1
    assert manager.check() == []

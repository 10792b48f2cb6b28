"""References held in chunked block-id lists (shmcache/shm/refs.py): sharing
costs 4 bytes a reference, so forks and many requests on one long prefix fit
while the pool has the blocks; running out of room for references is
reported as the seed reports running out of blocks; capacity shows in
get_stats() and `shmcache inspect`; a dead process's lists are released."""

from __future__ import annotations

import json
import subprocess

import pytest

from shmcache.shm import layout as L
from shmcache.errors import CapacityError, OutOfBlocksError

from _proc_client import family_tokens

LAYOUT = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")


def _prompt_table(m, rid, n_tokens):
    t = m.create_block_table(rid)
    m.prepare_append(t, n_tokens)
    return t


# ------------------------------------------------------------ fan-out fits
def test_256_forks_of_a_2048_token_prompt_fit_a_4096_block_pool(make_pool):
    """Default capacities. Before: every reference was an 8-byte record and
    max_refs ~ 2 x max_blocks, so the 66th fork failed with most blocks free."""
    m = make_pool(block_size=16, max_blocks=4096, **LAYOUT)
    t = _prompt_table(m, "prompt", 2048)
    forks = [m.fork_block_table(t, f"sample-{i}") for i in range(256)]
    s = m.get_stats()
    assert s.allocated_blocks == 1 + 128 and s.shared_blocks == 128
    assert s.refs_held == 257 * 128 <= s.max_refs
    assert s.block_tables == 257
    for f in forks:                              # every sample decodes a token
        m.prepare_append(f, 1)
    assert m.get_stats().allocated_blocks == 1 + 128 + 256
    assert m.check() == []
    for f in forks:
        m.delete_block_table(f.request_id)
    m.delete_block_table("prompt")
    s = m.get_stats()
    assert s.refs_held == 0 and s.allocated_blocks == 1 and m.check() == []


def test_64_samples_of_a_1000_token_prompt_on_a_1000_block_pool(make_pool):
    """The issue's measurement: 35 of 64 fitted, with 63 blocks in use."""
    m = make_pool(block_size=16, max_blocks=1000, **LAYOUT)
    t = _prompt_table(m, "prompt", 1000)
    forks = [m.fork_block_table(t, f"s{i}") for i in range(64)]
    for f in forks:
        m.prepare_append(f, 24)
    assert m.get_stats().block_tables == 65 and m.check() == []


def test_a_long_shared_prompt_admits_requests_until_the_blocks_run_out(make_pool):
    """The issue's measurement: a 4,000-token system prompt admitted 30
    requests with 20% of the blocks in use. Now only blocks limit it."""
    m = make_pool(block_size=16, max_blocks=1000, **LAYOUT)
    system = family_tokens(7, 4000)
    t = _prompt_table(m, "system", 4000)
    m.cache_full_blocks(t.block_ids, system, 0, 4000 // 16)
    admitted = 0
    while True:
        prompt = system + [admitted % 50000, 7, 7, 7]
        blocks, cached = m.acquire_computed_blocks(prompt)
        assert cached == 4000
        rt = m.create_block_table(f"req-{admitted}")
        for b in blocks:
            m.add_block_to_table(rt, b, 16)
        try:
            m.prepare_append(rt, len(prompt) - cached)
        except OutOfBlocksError as e:
            assert not isinstance(e, CapacityError), e      # blocks, not references
            m.delete_block_table(rt.request_id)
            break
        admitted += 1
    assert m.free_blocks == 0
    assert admitted == 999 - 250                 # every block not in the prompt: one per request
    assert m.check() == []


# ----------------------------------------------- running out: seed's signals
def test_out_of_references_is_the_seeds_out_of_blocks(make_pool):
    # 3 chunks: 15 references in the slot's list, a table and one spare
    m = make_pool(block_size=4, max_blocks=64, max_refs=15, max_tables=1, max_slots=1)
    assert m.layout.num_chunks == 3
    held = m.get_new_blocks(45)                  # the three chunks, full
    assert m.free_blocks == 63 - 45
    assert m.allocate_block() is None            # the seed's None, blocks left
    with pytest.raises(OutOfBlocksError) as ei:
        m.get_new_blocks(1)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, CapacityError)
    assert "max_refs" in str(ei.value)
    with pytest.raises(ValueError):
        m.touch([held[0]])
    with pytest.raises(ValueError):
        m.increment_ref(held[0].block_id)
    t = m.create_block_table("t")
    with pytest.raises(CapacityError):
        m.create_block_table("u")                # no table left: a ValueError too
    with pytest.raises(ValueError):
        m.prepare_append(t, 4)                   # the table needs a chunk
    assert m.check() == [] and m.free_blocks == 63 - 45
    m.free_block_batch(held[:15])                # a chunk back
    m.prepare_append(t, 4)
    assert m.allocate_block() is None            # (the table took it)
    m.delete_block_table("t")
    assert m.allocate_block() is not None
    assert m.check() == []


def test_max_refs_references_fit_however_spread(make_pool):
    """max_refs is a guarantee: every list's partly filled last chunk is paid for."""
    m = make_pool(block_size=4, max_blocks=64, max_refs=40, max_tables=8, max_slots=2)
    t = _prompt_table(m, "a", 4)
    tables = [t] + [m.fork_block_table(t, f"f{i}") for i in range(7)]   # 8 lists of 1
    blk = t.block_ids[0]
    m.touch([blk] * (40 - 8))                    # the rest in this slot's list
    assert m.get_stats().refs_held == 40 and m.check() == []
    assert len(tables) == 8


# --------------------------------------------------------------- capacity
def test_capacity_in_get_stats_and_memory_usage(make_pool):
    m = make_pool(block_size=4, max_blocks=32, max_tables=16, max_slots=8)
    lay = m.layout
    assert lay.max_refs == L.default_max_refs(32, 16) == 2 * 32 + 16 * 32
    t = _prompt_table(m, "a", 10)
    m.fork_block_table(t, "b")
    m.get_new_blocks(2)
    s = m.get_stats()
    assert (s.refs_held, s.max_refs) == (3 + 3 + 2, lay.max_refs)
    assert (s.block_tables, s.max_tables) == (2, 16)
    assert (s.attached, s.max_slots) == (1, 8)
    u = m.get_memory_usage()
    for k in ("refs_held", "max_refs", "block_tables", "max_tables", "attached", "max_slots"):
        assert u[k] == getattr(s, k), k


def test_capacity_in_shmcache_inspect(make_pool):
    m = make_pool(block_size=4, max_blocks=32)
    t = _prompt_table(m, "a", 10)
    m.fork_block_table(t, "b")
    from test_cli import CMD as exe
    d = json.loads(subprocess.run(exe + ["inspect", m.name, "--json"], capture_output=True,
                                  text=True, check=True).stdout)
    assert (d["refs_held"], d["max_refs"], d["block_tables"], d["max_tables"]) == \
        (6, m.layout.max_refs, 2, m.layout.max_tables)
    text = subprocess.run(exe + ["inspect", m.name], capture_output=True, text=True,
                          check=True).stdout
    line = next(s for s in text.splitlines() if s.startswith("capacity"))
    assert f"references 6/{m.layout.max_refs}" in line and "block tables 2/" in line


# -------------------------------------------------------------- structure
def test_lists_span_chunks_and_stay_consistent(manager):
    """Tables and loose lists across many chunks, with removals from the
    middle (a loose id moves into the hole), truncation and copies."""
    m = manager
    held = m.get_new_blocks(31)                  # three chunks of loose ids
    for b in held[::3]:                          # holes all over
        m.free_block(b.block_id)
    assert m.check() == []
    t = m.create_block_table("t")
    left = [b for i, b in enumerate(held) if i % 3]
    t.block_ids.extend([b.block_id for b in left] * 2)   # 40 ids: three chunks
    assert len(t) == 40 and m.pool.s_count[m.pool.slot] == 0
    f = m.fork_block_table(t, "f")
    assert f.block_ids == t.block_ids
    m.trim_table(f, 0)
    assert m.check() == []
    for _ in range(26):
        t.block_ids.pop()
    assert len(t) == 14 and m.check() == []
    m.free_block_batch([b for b, g in m.internals.holder.refs.loose.as_dict().items() for _ in g])   # the popped ones
    m.delete_block_table("t")
    m.delete_block_table("f")
    assert m.free_blocks == 31 and m.check() == []
    assert m.pool.c[L.C_FREE_REFS] == m.layout.num_chunks


# --------------------------------------------------------------- recovery
@pytest.mark.timeout(60)
def test_a_dead_process_with_long_lists_is_released(make_pool, spawn):
    m = make_pool(block_size=4, max_blocks=64, **LAYOUT)
    t = _prompt_table(m, "mine", 40)             # ten blocks
    before = m.get_stats()
    refs = m.pool.blocks["ref_count"].copy()
    w = spawn("serve", m.name)
    w.ready()
    w.call("alloc", n=20)                        # two chunks of loose ids
    for i in range(12):                          # forks of our table: its blocks shared
        w.call("fork", src="mine", dst=f"fork-{i}")
    w.call("create", rid="own")
    w.call("prepare_append", rid="own", n=4 * 17)     # a table of two chunks
    assert m.get_stats().refs_held == before.refs_held + 20 + 12 * 10 + 17
    w.kill()
    assert m.reclaim_dead() == 20 + 12 * 10 + 17
    s = m.get_stats()
    assert (s.refs_held, s.allocated_blocks, s.block_tables) == \
        (before.refs_held, before.allocated_blocks, 1)
    assert (m.pool.blocks["ref_count"] == refs).all()
    assert m.check() == []
    m.delete_block_table(t.request_id)
    assert m.pool.c[L.C_FREE_REFS] == m.layout.num_chunks and m.check() == []

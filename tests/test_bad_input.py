"""Bad input to the seed API: wrong ids, counts, tokens, sizes and segments
raise, and leave the pool unchanged (byte snapshots)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

import shmcache
from shmcache import layout as L
from shmcache import paged_cache as pc
from shmcache.errors import IncompatiblePoolError, PoolNotFoundError

from _helpers import cached_table, snapshot, toks, unchanged
from _helpers import pair as pair  # pytest fixtures

# ====================================================================== bad input
@pytest.mark.parametrize("bid", [-1, -100, 32, 10**9])
def test_bad_block_ids(manager, bid):
    manager.get_new_blocks(2)
    before = snapshot(manager)
    for call in (manager.free_block, manager.increment_ref, manager.decrement_ref,
                 lambda b: manager.free_block_batch([1, b]), lambda b: manager.touch([b]),
                 lambda b: manager.write_kv(b, 0, mx.zeros((1, 1, 8)), mx.zeros((1, 1, 8)))):
        with pytest.raises(ValueError):
            call(bid)
    t = manager.create_block_table("t")
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.add_block_to_table(t, bid, 1)
    unchanged(manager, before)


@pytest.mark.parametrize("bid", [1.0, "1", None, True])
def test_non_integer_block_ids(manager, bid):
    manager.get_new_blocks(2)
    before = snapshot(manager)
    for call in (manager.free_block, manager.increment_ref,
                 lambda b: manager.free_block_batch([b]), lambda b: manager.touch([b])):
        with pytest.raises(TypeError):
            call(bid)
    unchanged(manager, before)


def test_double_free(manager):
    b = manager.allocate_block()
    t = manager.create_block_table("t")
    x = manager.allocate_block()
    manager.add_block_to_table(t, x, 1)
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.free_block(x.block_id)               # referenced, but not by a loose ref
    with pytest.raises(ValueError):
        manager.free_block_batch([b, b])             # twice in one batch
    with pytest.raises(ValueError):
        manager.free_block_batch([b, x])             # nothing freed, not even b
    unchanged(manager, before)
    assert manager.free_block(b.block_id) is True
    before = snapshot(manager)
    assert manager.free_block(b.block_id) is False   # the seed's "unknown block"
    with pytest.raises(ValueError):
        manager.free_block_batch([b])
    unchanged(manager, before)


def test_double_free_of_another_managers_block(pair):
    m, other = pair
    b = m.allocate_block()
    before = snapshot(m)
    with pytest.raises(ValueError):
        other.free_block(b.block_id)
    with pytest.raises(ValueError):
        other.free_block_batch([b.block_id])
    assert b.ref_count == 1
    assert m.check() == []
    assert snapshot(m)[2] == before[2]


def test_freeing_the_null_block(manager):
    before = snapshot(manager)
    assert manager.free_block(0) is False
    assert manager.decrement_ref(0) is False
    assert manager.increment_ref(0) is False
    with pytest.raises(ValueError):
        manager.free_block_batch([0])
    with pytest.raises(ValueError):
        manager.free_block_batch([manager.null_block])
    unchanged(manager, before)
    assert manager.null_block.ref_count == 1


def test_null_block_cannot_be_cached_or_tabled(manager):
    t = manager.create_block_table("t")
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.null_block.block_hash = pc.BlockHash(b"x" * 16)
    with pytest.raises(ValueError):
        manager.add_block_to_table(t, manager.null_block, 1)
    with pytest.raises(ValueError):
        manager.cache_full_blocks([manager.null_block], toks(4), 0, 1)
    with pytest.raises(AttributeError):
        manager.blocks[3].is_null = True
    unchanged(manager, before)


def test_free_block_unknown_free_block(manager):
    before = snapshot(manager)
    assert manager.free_block(7) is False
    assert manager.increment_ref(7) is False
    unchanged(manager, before)


def test_unknown_request_ids(manager):
    t, _, _ = cached_table(manager, "real", 1)
    before = snapshot(manager)
    assert manager.get_block_table("nope") is None
    with pytest.raises(KeyError):
        manager.delete_block_table("nope")
    with pytest.raises(KeyError):
        manager.fork_block_table("nope", "new")
    with pytest.raises(KeyError):
        manager.prepare_append("nope", 1)
    with pytest.raises(KeyError):
        manager.can_append("nope", 1)
    with pytest.raises(KeyError):
        manager.get_blocks_for_generation("nope")
    with pytest.raises(KeyError):
        manager.add_block_to_table("nope", 1, 1)
    with pytest.raises(KeyError):
        manager.request_tables["nope"]
    unchanged(manager, before)
    # a stale table object after its deletion
    b = manager.allocate_block()
    manager.delete_block_table("real")
    before = snapshot(manager)
    with pytest.raises(KeyError):
        manager.add_block_to_table(t, b, 1)
    with pytest.raises(KeyError):
        manager.prepare_append(t, 1)
    with pytest.raises(KeyError):
        manager.fork_block_table(t, "x")
    unchanged(manager, before)


def test_stale_table_view_does_not_match_a_reused_slot(manager):
    t = manager.create_block_table("a")
    manager.delete_block_table("a")
    manager.create_block_table("b")                   # may reuse a's slot
    with pytest.raises(KeyError):
        manager.prepare_append(t, 1)
    assert manager.get_block_table("b").num_tokens == 0


@pytest.mark.parametrize("rid", ["", 5, None, b"bytes", "x" * 65, "nul\x00"])
def test_bad_request_ids(manager, rid):
    before = snapshot(manager)
    with pytest.raises((TypeError, ValueError)):
        manager.create_block_table(rid)
    with pytest.raises((TypeError, ValueError)):
        manager.get_block_table(rid)
    unchanged(manager, before)


def test_duplicate_request_ids(manager):
    t, ids, _ = cached_table(manager, "dup", 2)
    manager.create_block_table("other")
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.create_block_table("dup")
    with pytest.raises(ValueError):
        manager.fork_block_table(t, "other")
    with pytest.raises(ValueError):
        manager.fork_block_table(t, "dup")
    unchanged(manager, before)
    assert [manager.blocks[i].ref_count for i in ids] == [1, 1]


def test_duplicate_request_id_across_managers(pair):
    m, other = pair
    m.create_block_table("r")
    before = snapshot(m)
    with pytest.raises(ValueError):
        other.create_block_table("r")
    assert snapshot(m)[2] == before[2]


BAD_TOKENS = [([1, 2, -3, 4], ValueError), ([1, 2, 2**32, 4], ValueError),
              ([1, "a", 3, 4], TypeError), ([1.5, 2, 3, 4], TypeError),
              ([None] * 4, TypeError), ([[1], [2], [3], [4]], TypeError)]


@pytest.mark.parametrize("bad,exc", BAD_TOKENS)
def test_bad_tokens(manager, bad, exc):
    t, ids, _ = cached_table(manager, "r", 1)
    b = manager.allocate_block()
    before = snapshot(manager)
    calls = [lambda: manager.get_computed_blocks(bad),
             lambda: manager.acquire_computed_blocks(bad),
             lambda: manager.find_shared_prefix(bad),
             lambda: manager.find_cached_block(bad),
             lambda: manager.register_block_hash(b, bad),
             lambda: manager.cache_full_blocks([b], bad, 0, 1),
             lambda: manager.compute_block_hash(bad)]
    for call in calls:
        with pytest.raises(exc):
            call()
    unchanged(manager, before)


def test_cache_full_blocks_bad_counts(manager):
    blocks = manager.get_new_blocks(2)
    before = snapshot(manager)
    for args in ((blocks, toks(8), -1, 2), (blocks, toks(8), 0, 3), (blocks, toks(7), 0, 2),
                 (blocks, toks(8), 0, 1.5), (blocks, toks(8), True, 2)):
        with pytest.raises(ValueError):
            manager.cache_full_blocks(*args)
    manager.cache_full_blocks(blocks, toks(8), 2, 1)            # nothing to do
    unchanged(manager, before)
    free = manager.get_new_blocks(1)[0]
    manager.free_block(free.block_id)
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.cache_full_blocks([free], toks(4), 0, 1)        # a free block
    unchanged(manager, before)


@pytest.mark.parametrize("n", [-1, -10, 1.5, "2", True])
def test_bad_counts(manager, n):
    t = manager.create_block_table("r")
    manager.prepare_append(t, 3)
    before = snapshot(manager)
    for call in (manager.get_new_blocks, manager.allocate_blocks_for_tokens,
                 manager.evict_lru_blocks, lambda k: manager.prepare_append(t, k),
                 lambda k: manager.can_append(t, k)):
        with pytest.raises(ValueError):
            call(n)
    unchanged(manager, before)


@pytest.mark.parametrize("n", [-1, 5, 1.5, None])
def test_bad_tokens_in_block(manager, n):
    t = manager.create_block_table("r")
    b = manager.allocate_block()
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.add_block_to_table(t, b, n)
    with pytest.raises(ValueError):
        b.token_count = n
    unchanged(manager, before)


def test_add_block_not_held_takes_a_reference(pair):
    """A block this manager holds no reference to gets one of the table's
    own (as touch takes one): the seed's callers append blocks they took no
    reference on, and the table's references must still add up."""
    m, other = pair
    t = m.create_block_table("r")
    b = other.allocate_block()
    m.add_block_to_table(t, b, 1)                   # another manager's block
    assert b.ref_count == 2 and other._refs.holds_loose(b.block_id)
    free = m.free_blocks
    m.add_block_to_table(t, 9, 1)                   # a free block: out of the queue
    assert m.blocks[9].ref_count == 1 and m.free_blocks == free - 1
    assert t.block_ids == [b.block_id, 9] and m.check() == []
    m.delete_block_table("r")
    assert b.ref_count == 1 and m.blocks[9].ref_count == 0 and m.check() == []
    with pytest.raises(ValueError):
        m.add_block_to_table(m.create_block_table("s"), 0, 1)   # the null block


@pytest.mark.parametrize("kw", [dict(block_size=0), dict(block_size=-4), dict(max_blocks=0),
                                dict(max_blocks=1), dict(max_blocks=-5), dict(block_size=2.0),
                                dict(max_blocks="10"), dict(block_size=True)])
def test_bad_manager_sizes(kw):
    with pytest.raises((TypeError, ValueError)):
        pc.PagedCacheManager(**kw)


@pytest.mark.parametrize("kw", [dict(num_kv_heads=0), dict(head_dim=0), dict(head_dim=-1),
                                dict(num_layers=-1), dict(max_slots=0), dict(max_tables=0),
                                dict(max_refs=0), dict(dtype="int8"), dict(block_size=0),
                                dict(max_blocks=1), dict(max_slots=L.MAX_SLOTS_LIMIT + 1),
                                dict(max_tables=L.MAX_TABLES_LIMIT + 1),
                                dict(block_size=65536), dict(max_blocks=2**31)])
def test_bad_pool_sizes(pool_name, kw):
    with pytest.raises((TypeError, ValueError)):
        shmcache.create_pool(pool_name, **kw)
    assert not os.path.exists(f"/dev/shm/shmcache.{pool_name}")


def test_attach_nonexistent(pool_name):
    with pytest.raises(PoolNotFoundError):
        shmcache.attach(pool_name)


def _fake_segment(name: str, data: bytes) -> str:
    path = f"/dev/shm/shmcache.{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return path


def _header(**fields) -> bytes:
    h = np.zeros(1, L.HEADER_DTYPE)
    h["magic"] = L.MAGIC
    h["version"] = L.LAYOUT_VERSION
    h["ready"] = 1
    for k, v in dict(block_size=4, max_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype_code=1, max_slots=4, max_tables=8, max_refs=32).items():
        h[k] = v
    for k, v in fields.items():
        h[k] = v
    return h.tobytes().ljust(L.HEADER_SIZE + 4096, b"\0")


@pytest.mark.parametrize("case", ["not a pool", "other version", "never ready", "too small",
                                  "truncated", "zero bytes"])
def test_attach_incompatible_segment(pool_name, case):
    data = {"not a pool": b"hello world, not a pool".ljust(8192, b"\0"),
            "other version": _header(version=L.LAYOUT_VERSION + 1),
            "never ready": _header(ready=0),
            "too small": b"tiny",
            "truncated": _header(max_blocks=1000),
            "zero bytes": b""}[case]
    path = _fake_segment(pool_name, data)
    try:
        with pytest.raises(IncompatiblePoolError) as ei:
            shmcache.attach(pool_name, timeout=0.05)
        assert pool_name in str(ei.value) or path in str(ei.value)
        if case == "other version":
            assert str(L.LAYOUT_VERSION + 1) in str(ei.value)
        assert os.path.exists(path)                          # left alone
        with open(path, "rb") as f:
            assert f.read() == data
    finally:
        os.unlink(path)


def test_creator_survives_failed_attach_of_other_name(make_pool, pool_name):
    m = make_pool()
    path = _fake_segment(pool_name, _header(version=0))
    try:
        with pytest.raises(IncompatiblePoolError):
            shmcache.attach(pool_name, timeout=0.05)
    finally:
        os.unlink(path)
    assert m.check() == [] and m.free_blocks == 31


# ====================================================================== corrupt headers
def _pool_bytes(make_pool) -> bytes:
    m = make_pool(block_size=4, max_blocks=8)
    m.get_new_blocks(2)
    with open(f"/dev/shm/shmcache.{m.name}", "rb") as f:
        return f.read()


@pytest.mark.parametrize("field,value,words", [
    ("max_slots", 1, "total_size"),                 # once: the null block three times
    ("max_blocks", 0, "max_blocks 0"),              # once: block ids of -1
    ("dtype_code", 9, "unknown dtype code 9"),      # once: a KeyError traceback
    ("max_refs", 10**6, "total_size"),
    ("hash_capacity", 4, "hash_capacity 4"),
    ("enable_caching", 7, "enable_caching 7"),
    ("created_at", 1.0, "checksum"),                # sizes agree, the checksum does not
    ("total_size", 1 << 40, "total_size"),
])
def test_attach_refuses_a_corrupt_header(make_pool, pool_name, field, value, words):
    """Every size and offset in the header is checked against the others, the
    layout version and the file's size (and a checksum covers the rest)."""
    from shmcache.errors import CorruptPoolError
    data = bytearray(_pool_bytes(make_pool))
    h = np.frombuffer(data, L.HEADER_DTYPE, 1)
    h[field] = value
    path = _fake_segment(pool_name, bytes(data))
    try:
        with pytest.raises(CorruptPoolError) as ei:
            shmcache.attach(pool_name, timeout=0.05)
        assert words in str(ei.value) and pool_name in str(ei.value)
        assert isinstance(ei.value, IncompatiblePoolError)
        with open(path, "rb") as f:
            assert f.read() == bytes(data)          # left alone
    finally:
        os.unlink(path)


def test_attach_refuses_a_file_of_another_size(make_pool, pool_name):
    from shmcache.errors import CorruptPoolError
    data = _pool_bytes(make_pool)
    for extra in (b"\0" * 4096, None):
        body = data + extra if extra else data[:-4096]
        path = _fake_segment(pool_name, body)
        try:
            with pytest.raises(CorruptPoolError, match="the file is"):
                shmcache.attach(pool_name, timeout=0.05)
        finally:
            os.unlink(path)


# ====================================================================== huge counts
@pytest.mark.parametrize("n", [2**40, 2**63, 10**30, 32, 31])
def test_get_new_blocks_more_than_the_pool_has(manager, n):
    """The C path sized a buffer by the count before checking it (MemoryError,
    OverflowError): any count the pool cannot have is the seed's ValueError."""
    manager.get_new_blocks(2)
    before = snapshot(manager)
    with pytest.raises(shmcache.OutOfBlocksError) as ei:
        manager.get_new_blocks(n)
    assert isinstance(ei.value, ValueError) and str(n) in str(ei.value)
    with pytest.raises(ValueError):
        manager.allocate_blocks_for_tokens(n * manager.block_size)
    unchanged(manager, before)
    assert len(manager.get_new_blocks(29)) == 29    # all that is left still works

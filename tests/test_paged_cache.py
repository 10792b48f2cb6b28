"""The seed API (shmcache.paged_cache) over private and named pools: surface,
behaviour, the seed's fixed bugs, check(), close(), and bad input."""

from __future__ import annotations

import ast
import gc
import inspect
import os
import random

import mlx.core as mx
import numpy as np
import pytest

import shmcache
from shmcache import layout as L
from shmcache import paged_cache as pc
from shmcache.errors import (IncompatiblePoolError, OutOfBlocksError, PoolClosedError,
                             PoolNotFoundError)

# ====================================================================== helpers
BS = 4


def toks(n: int, base: int = 0) -> list:
    return list(range(base, base + n))


def cached_table(m, rid: str, n_blocks: int, base: int = 0, extra_keys=None):
    t = m.create_block_table(rid)
    blocks = m.get_new_blocks(n_blocks)
    tokens = toks(n_blocks * m.block_size, base)
    for b in blocks:
        m.add_block_to_table(t, b, m.block_size)
    m.cache_full_blocks(blocks, tokens, 0, n_blocks, extra_keys=extra_keys)
    return t, [b.block_id for b in blocks], tokens


def snapshot(m):
    """Every metadata byte of the pool except the lock bookkeeping counters,
    plus the manager's private index of its own references."""
    p = m._p
    lay = p.layout
    c = p.counters.copy()
    c[[L.C_OPS, L.C_LOCK_WAIT_NS, L.C_DIRTY]] = 0
    return (bytes(p.mm[:lay.counters_off]), c.tobytes(),
            bytes(p.mm[lay.slots_off:lay.arena_off]),
            {k: list(v) for k, v in m._refs.loose.items()})


def unchanged(m, before) -> None:
    after = snapshot(m)
    assert after[0] == before[0], "header changed"
    assert after[1] == before[1], "counters changed"
    assert after[2] == before[2], "slots/blocks/indexes/tables changed"
    assert after[3] == before[3], "the manager's reference map changed"
    assert m.check() == []


def full_scan(m) -> dict:
    """Statistics recomputed from scratch from the raw records."""
    p = m._p
    n = m.max_blocks
    ref = [p.b_ref[b] for b in range(n)]
    free, cur = 0, p.b_next[p.HEAD]
    while cur != p.TAIL:
        free += 1
        cur = p.b_next[cur]
    return {"total_blocks": n,
            "allocated_blocks": sum(1 for r in ref if r > 0),
            "free_blocks": free,
            "shared_blocks": sum(1 for b in range(1, n) if ref[b] > 1),
            "total_tokens_cached": sum(p.b_tok[b] for b in range(1, n) if ref[b] > 0)}


def stats_dict(s) -> dict:
    return {k: getattr(s, k) for k in ("total_blocks", "allocated_blocks", "free_blocks",
                                       "shared_blocks", "total_tokens_cached")}


@pytest.fixture
def pair(make_pool):
    """(creator, attached) managers of one named pool, block_size 4, 32 blocks."""
    m = make_pool(block_size=BS, max_blocks=32)
    other = shmcache.attach(m.name)
    yield m, other
    other.close()


@pytest.fixture
def kvpool(make_pool):
    return make_pool(block_size=BS, max_blocks=16, num_layers=2, num_kv_heads=2, head_dim=4,
                     dtype="float32")


def kv_data(m, seed: int, tokens: int = BS):
    lay = m.layout
    a = np.random.default_rng(seed).standard_normal(
        (lay.num_kv_heads, tokens, lay.head_dim)).astype(np.float32)
    return mx.array(a)


def payload(m, b: int) -> bytes:
    return m._p.arena[:, :, :, b].tobytes()


# ====================================================================== API surface
PUBLIC = ["BlockHash", "CacheBlock", "KVCacheBlock", "FreeKVCacheBlockQueue",
          "BlockHashToBlockMap", "BlockTable", "CacheStats", "PagedCacheManager",
          "compute_block_hash"]

# The signatures written in the seed reference (vllm_mlx.paged_cache.txt).
SEED_SIGNATURES = {
    "CacheBlock": "block_id: int, ref_count: int = 0, block_hash: Optional[BlockHash] = None, prev_free_block: Optional['CacheBlock'] = None, next_free_block: Optional['CacheBlock'] = None, is_null: bool = False, cache_data: Optional[List[Tuple[Any, Any]]] = None, token_count: int = 0, hash_value: Optional[str] = None, last_access: float = time()",  # noqa: E501
    "CacheBlock.is_full": "block_size: int",
    "CacheBlock.is_shared": "",
    "CacheBlock.reset_hash": "",
    "CacheBlock.touch": "",
    "FreeKVCacheBlockQueue": "blocks: List[CacheBlock]",
    "FreeKVCacheBlockQueue.popleft": "",
    "FreeKVCacheBlockQueue.popleft_n": "n: int",
    "FreeKVCacheBlockQueue.remove": "block: CacheBlock",
    "FreeKVCacheBlockQueue.append": "block: CacheBlock",
    "FreeKVCacheBlockQueue.append_n": "blocks: List[CacheBlock]",
    "FreeKVCacheBlockQueue.get_all_free_blocks": "",
    "BlockHashToBlockMap": "",
    "BlockHashToBlockMap.get_block": "block_hash: BlockHash",
    "BlockHashToBlockMap.insert": "block_hash: BlockHash, block: CacheBlock",
    "BlockHashToBlockMap.pop": "block_hash: BlockHash, block_id: int",
    "BlockHashToBlockMap.__len__": "",
    "BlockHashToBlockMap.clear": "",
    "BlockTable": "request_id: str, block_ids: List[int] = list(), num_tokens: int = 0",
    "BlockTable.add_block": "block_id: int, num_tokens: int",
    "BlockTable.__len__": "",
    "BlockTable.copy": "new_request_id: str",
    "CacheStats": "total_blocks: int = 0, allocated_blocks: int = 0, free_blocks: int = 0, shared_blocks: int = 0, total_tokens_cached: int = 0, cache_hits: int = 0, cache_misses: int = 0, cow_copies: int = 0, evictions: int = 0",  # noqa: E501
    "PagedCacheManager": "block_size: int = 64, max_blocks: int = 1000, enable_caching: bool = True",
    "PagedCacheManager.allocate_block": "",
    "PagedCacheManager.get_new_blocks": "num_blocks: int",
    "PagedCacheManager._maybe_evict_cached_block": "block: CacheBlock",
    "PagedCacheManager.free_block": "block_id: int",
    "PagedCacheManager.touch": "blocks: Iterable[CacheBlock]",
    "PagedCacheManager.increment_ref": "block_id: int",
    "PagedCacheManager.decrement_ref": "block_id: int",
    "PagedCacheManager.get_cached_block": "block_hash: BlockHash",
    "PagedCacheManager.cache_full_blocks": "blocks: List[CacheBlock], token_ids: List[int], num_cached_blocks: int, num_full_blocks: int",  # noqa: E501
    "PagedCacheManager.get_computed_blocks": "token_ids: List[int]",
    "PagedCacheManager.compute_block_hash": "tokens: List[int]",
    "PagedCacheManager.find_cached_block": "tokens: List[int]",
    "PagedCacheManager.register_block_hash": "block: CacheBlock, tokens: List[int]",
    "PagedCacheManager.create_block_table": "request_id: str",
    "PagedCacheManager.get_block_table": "request_id: str",
    "PagedCacheManager.get_or_create_block_table": "request_id: str",
    "PagedCacheManager.delete_block_table": "request_id: str",
    "PagedCacheManager.add_block_to_table": "table: BlockTable, block: CacheBlock, tokens_in_block: int",
    "PagedCacheManager.find_shared_prefix": "tokens: List[int]",
    "PagedCacheManager.fork_block_table": "source_table: BlockTable, new_request_id: str",
    "PagedCacheManager.get_blocks_for_generation": "table: BlockTable",
    "PagedCacheManager._cow_copy_block": "source_block: CacheBlock",
    "PagedCacheManager.allocate_blocks_for_tokens": "num_tokens: int",
    "PagedCacheManager.evict_lru_blocks": "num_blocks: int",
    "PagedCacheManager.handle_memory_pressure": "requested_blocks: int",
    "PagedCacheManager.get_stats": "",
    "PagedCacheManager.get_memory_usage": "",
    "PagedCacheManager.reset_stats": "",
    "PagedCacheManager.reset_prefix_cache": "",
    "PagedCacheManager.clear": "",
    "compute_block_hash": "parent_hash: Optional[BlockHash], token_ids: List[int], extra_keys: Optional[Tuple[Any, ...]] = None",  # noqa: E501
}
_FACTORY_DEFAULTS = {"time()", "list()"}    # dataclass default_factory fields


def _seed_params(text: str) -> list:
    fn = ast.parse(f"def f({text}): pass").body[0].args
    names = [a.arg for a in fn.args]
    defaults = [None] * (len(names) - len(fn.defaults)) + [ast.unparse(d) for d in fn.defaults]
    return list(zip(names, defaults))


def _resolve(path: str):
    obj = getattr(pc, path.split(".")[0])
    for part in path.split(".")[1:]:
        obj = inspect.getattr_static(obj, part)
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    return obj


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_exists(name):
    assert hasattr(pc, name)
    assert name in pc.__all__


@pytest.mark.parametrize("path", sorted(SEED_SIGNATURES))
def test_seed_signature(path):
    obj = _resolve(path)
    sig = inspect.signature(obj)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    seed = _seed_params(SEED_SIGNATURES[path])
    assert len(params) >= len(seed), f"{path}: missing parameters"
    for (name, default), p in zip(seed, params):
        assert p.name == name, f"{path}: parameter {p.name!r}, seed has {name!r}"
        assert p.kind == p.POSITIONAL_OR_KEYWORD, f"{path}: {name} is {p.kind}"
        if default is None:
            assert p.default is p.empty, f"{path}: {name} should be required"
        elif default not in _FACTORY_DEFAULTS:
            assert p.default == ast.literal_eval(default), f"{path}: {name} default"
    for p in params[len(seed):]:    # additions must not break seed callers
        assert p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is not p.empty, \
            f"{path}: extra required parameter {p.name}"


def test_seed_default_factories():
    b1 = pc.CacheBlock(block_id=1)
    assert b1.last_access > 0
    t1, t2 = pc.BlockTable("a"), pc.BlockTable("b")
    assert t1.block_ids == [] and t1.block_ids is not t2.block_ids


def test_manager_attributes_have_seed_shapes(manager):
    m = manager
    assert (m.block_size, m.max_blocks, m.enable_caching) == (4, 32, True)
    assert isinstance(m.free_blocks, int) and not callable(m.free_blocks)
    assert m.usage == 0.0
    assert isinstance(m.null_block, pc.CacheBlock) and m.null_block.block_id == 0
    assert m.null_block.is_null and m.null_block.ref_count == 1
    assert len(m.blocks) == 32 and m.blocks[5].block_id == 5 and m.blocks[-1].block_id == 31
    assert isinstance(m.stats, pc.CacheStats)
    assert isinstance(m.get_stats(), pc.CacheStats)
    q = m.free_block_queue
    for meth in ("popleft", "popleft_n", "remove", "append", "append_n", "get_all_free_blocks"):
        assert callable(getattr(q, meth))
    h = m.cached_block_hash_to_block
    for meth in ("get_block", "insert", "pop", "__len__", "clear"):
        assert callable(getattr(h, meth))
    with m._lock:                # the seed's RLock: re-entrant
        with m._lock:
            m.allocate_block()
    assert m.free_blocks == 30


def test_default_constructor_and_sizes():
    m = pc.PagedCacheManager()
    try:
        assert (m.block_size, m.max_blocks, m.enable_caching) == (64, 1000, True)
        assert m.free_blocks == 999
        assert m.get_stats().total_blocks == 1000
    finally:
        m.close()


def test_compute_block_hash_static_legacy(manager):
    h = pc.PagedCacheManager.compute_block_hash([1, 2, 3])
    assert isinstance(h, str) and len(h) == 16
    assert h == manager.compute_block_hash([1, 2, 3])
    assert h != manager.compute_block_hash([1, 2, 4])


def test_get_memory_usage(manager):
    manager.get_new_blocks(3)
    u = manager.get_memory_usage()
    for k in ("block_size", "max_blocks", "allocated_blocks", "free_blocks", "shared_blocks",
              "total_tokens_cached", "utilization", "cache_hit_rate"):
        assert k in u
    assert u["allocated_blocks"] == 4 and u["free_blocks"] == 28
    assert u["utilization"] == 4 / 32


# ====================================================================== allocation
@pytest.mark.parametrize("kind", ["private", "named"])
def test_allocate_until_full_returns_none(make_pool, kind):
    m = (pc.PagedCacheManager(block_size=4, max_blocks=6) if kind == "private"
         else make_pool(block_size=4, max_blocks=6))
    try:
        got = [m.allocate_block() for _ in range(5)]
        assert sorted(b.block_id for b in got) == [1, 2, 3, 4, 5]
        assert all(b.ref_count == 1 and b.token_count == 0 for b in got)
        assert m.free_blocks == 0 and m.usage == 1.0
        before = snapshot(m)
        assert m.allocate_block() is None
        unchanged(m, before)
    finally:
        if kind == "private":
            m.close()


def test_get_new_blocks_raises_when_not_enough(manager):
    got = manager.get_new_blocks(30)
    assert len({b.block_id for b in got}) == 30
    assert manager.get_new_blocks(0) == []
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.get_new_blocks(2)
    with pytest.raises(OutOfBlocksError):
        manager.get_new_blocks(2)
    unchanged(manager, before)
    assert len(manager.get_new_blocks(1)) == 1


def test_allocate_blocks_for_tokens(manager):
    assert len(manager.allocate_blocks_for_tokens(0)) == 0
    assert len(manager.allocate_blocks_for_tokens(1)) == 1
    assert len(manager.allocate_blocks_for_tokens(4)) == 1
    assert len(manager.allocate_blocks_for_tokens(9)) == 3
    assert manager.free_blocks == 31 - 5


def test_free_block_returns_true_then_false(manager):
    b = manager.allocate_block()
    manager.increment_ref(b.block_id)
    assert b.ref_count == 2 and b.is_shared()
    assert manager.free_block(b.block_id) is False   # still referenced
    assert b.ref_count == 1
    assert manager.decrement_ref(b.block_id) is True
    assert b.ref_count == 0
    assert manager.free_block(b.block_id) is False   # unknown (free) block
    assert manager.check() == []


def test_free_block_accepts_views(manager):
    b = manager.allocate_block()
    manager.free_block_batch([b])
    assert manager.free_blocks == 31


def test_handle_memory_pressure(manager):
    assert manager.handle_memory_pressure(31)
    assert not manager.handle_memory_pressure(32)
    manager.get_new_blocks(10)
    assert manager.handle_memory_pressure(21) and not manager.handle_memory_pressure(22)


def test_touch_takes_refs_and_unlinks_free_blocks(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    manager.delete_block_table("r")
    assert manager.free_blocks == 31
    blocks = [manager.blocks[i] for i in ids]
    manager.touch(blocks)
    assert [b.ref_count for b in blocks] == [1, 1]
    assert manager.free_blocks == 29
    assert not set(ids) & set(manager.free_block_queue.ids())
    manager.touch([manager.null_block])           # the null block is left alone
    assert manager.null_block.ref_count == 1
    manager.free_block_batch(blocks)
    assert manager.free_blocks == 31 and manager.check() == []


# ====================================================================== live views
def test_block_view_reflects_other_manager(pair):
    m, other = pair
    b = m.allocate_block()
    ob = other.blocks[b.block_id]
    assert ob.ref_count == 1
    other.increment_ref(b.block_id)
    assert b.ref_count == 2 and b.is_shared()
    other.blocks[b.block_id].token_count = 3
    assert b.token_count == 3 and not b.is_full(4)
    ob.token_count = 4
    assert b.is_full(4)
    other.cache_full_blocks([ob], toks(4), 0, 1)
    assert b.block_hash is not None and b.block_hash == ob.block_hash
    assert b.hash_value == b.block_hash.hex()
    import time
    later = time.time() + 100.0
    ob.last_access = later
    assert abs(b.last_access - later) < 0.01
    ob.touch()
    assert b.last_access < later - 50          # touch: now, earlier than "later"
    b.reset_hash()
    assert ob.block_hash is None
    assert other.get_computed_blocks(toks(4)) == ([], 0)
    assert isinstance(b, pc.CacheBlock) and isinstance(b, pc.KVCacheBlock)
    other.free_block(b.block_id)
    m.free_block(b.block_id)
    assert ob.ref_count == 0


def test_block_view_block_hash_assignment(manager):
    b = manager.allocate_block()
    h = pc.BlockHash(os.urandom(16))
    b.block_hash = h
    assert b.block_hash == h
    assert manager.get_cached_block(h) == b
    assert manager.cached_block_hash_to_block.get_block(h) == b
    with pytest.raises(ValueError):
        b.block_hash = b"short"
    assert b.block_hash == h
    b.block_hash = None
    assert manager.get_cached_block(h) is None
    assert manager.check() == []


def test_block_view_ref_count_cannot_be_assigned(manager):
    b = manager.allocate_block()
    before = snapshot(manager)
    with pytest.raises(AttributeError):
        b.ref_count = 5
    unchanged(manager, before)


def test_table_view_shared_between_managers(pair):
    m, other = pair
    t = m.create_block_table("req")
    m.add_block_to_table(t, m.allocate_block(), 4)
    ot = other.get_block_table("req")
    assert ot is not None and ot.block_ids == t.block_ids and ot.num_tokens == 4
    ot.add_block(other.allocate_block().block_id, 2)      # BlockTable.add_block, live
    assert len(t) == 2 and t.num_tokens == 6 and t.block_ids == ot.block_ids
    c = t.copy("copy")
    assert isinstance(c, pc.BlockTable) and c.block_ids == t.block_ids
    other.delete_block_table("req")
    assert m.get_block_table("req") is None
    with pytest.raises(KeyError):
        len(t)
    assert m.free_blocks == 31 and m.check() == []


def test_free_queue_shared_between_managers(pair):
    m, other = pair
    m.get_new_blocks(3)
    assert other.free_block_queue.ids() == m.free_block_queue.ids()
    assert other.free_blocks == m.free_blocks == 28


# ====================================================================== dict-like views
def test_allocated_blocks_view(pair):
    m, other = pair
    a = m.allocated_blocks
    assert len(a) == 1 and 0 in a and list(a) == [0]
    blocks = other.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    assert len(a) == 4
    assert all(i in a for i in ids)
    assert set(a) == {0, *ids}
    assert a[ids[0]].block_id == ids[0] and a[ids[0]].ref_count == 1
    assert 20 not in a and -1 not in a and "x" not in a and 999 not in a
    with pytest.raises(KeyError):
        a[20]
    assert a.get(20) is None
    assert set(a.keys()) == set(a)
    other.free_block_batch(blocks)
    assert len(a) == 1


def test_request_tables_view(pair):
    m, other = pair
    r = m.request_tables
    assert len(r) == 0 and list(r) == []
    other.create_block_table("a")
    m.create_block_table("b")
    assert len(r) == 2 and set(r) == {"a", "b"}
    assert "a" in r and "zz" not in r and 5 not in r
    assert r["a"].request_id == "a"
    assert isinstance(r["a"], pc.BlockTable)
    with pytest.raises(KeyError):
        r["zz"]
    assert r.get("zz") is None
    m.delete_block_table("a")
    assert set(other.request_tables) == {"b"}


def test_hash_to_block_view(pair):
    m, other = pair
    h = m.hash_to_block
    assert len(h) == 0
    t, ids, tokens = cached_table(other, "r", 2)
    assert len(h) == 2
    keys = list(h)
    assert all(isinstance(k, str) for k in keys)
    assert {h[k] for k in keys} == set(ids)
    assert keys[0] in h and "00" * 16 not in h and "not-hex" not in h
    with pytest.raises(KeyError):
        h["00" * 16]
    assert h[other.blocks[ids[1]].block_hash.hex()] == ids[1]
    assert dict(h) == {other.blocks[i].block_hash.hex(): i for i in ids}


def test_hash_to_block_view_with_two_blocks_per_hash(manager):
    cached_table(manager, "a", 1)
    cached_table(manager, "b", 1)      # same tokens, cached again in another block
    assert len(manager.cached_block_hash_to_block) == 1
    h = manager.hash_to_block
    assert len(h) == len(list(h)) == 1
    assert h[list(h)[0]] in manager.request_tables["a"].block_ids + \
        manager.request_tables["b"].block_ids
    assert manager.check() == []


def test_cached_block_hash_to_block_map(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    hm = manager.cached_block_hash_to_block
    h0 = manager.blocks[ids[0]].block_hash
    assert len(hm) == 2
    assert hm.get_block(h0).block_id == ids[0]
    assert hm.pop(h0, ids[1]) is None                 # wrong id: nothing popped
    assert hm.get_block(h0).block_id == ids[0]
    assert hm.pop(h0, ids[0]).block_id == ids[0]
    assert hm.get_block(h0) is None and len(hm) == 1
    hm.insert(h0, manager.blocks[ids[0]])
    assert hm.get_block(h0).block_id == ids[0]
    hm.clear()
    assert len(hm) == 0 and manager.get_computed_blocks(tokens) == ([], 0)
    assert manager.check() == []


# ====================================================================== stats
def test_stats_counters_are_shared(pair):
    m, other = pair
    cached_table(m, "r", 2)
    other.get_computed_blocks(toks(8))
    assert m.stats.cache_hits == other.stats.cache_hits == 2
    other.get_computed_blocks(toks(4, base=900))
    assert m.stats.cache_misses == 1
    m.stats.cache_hits = 40
    assert other.stats.cache_hits == 40 == other.get_stats().cache_hits
    other.reset_stats()
    assert m.stats.cache_hits == 0 and m.stats.cache_misses == 0
    assert m.stats.allocated_blocks == 3          # derived: null + 2
    with pytest.raises(AttributeError):
        m.stats.allocated_blocks = 5


def test_get_stats_is_a_snapshot(manager):
    s = manager.get_stats()
    manager.get_new_blocks(2)
    assert s.allocated_blocks == 1 and manager.get_stats().allocated_blocks == 3


def test_get_stats_equals_full_scan_after_random_ops(pair):
    m, other = pair
    rng = random.Random(11)
    loose = {id(m): [], id(other): []}
    tables = []
    for step in range(250):
        mg = rng.choice((m, other))
        op = rng.randrange(8)
        try:
            if op == 0:
                b = mg.allocate_block()
                if b is not None:
                    loose[id(mg)].append(b.block_id)
            elif op == 1 and loose[id(mg)]:
                mg.free_block(loose[id(mg)].pop(rng.randrange(len(loose[id(mg)]))))
            elif op == 2:
                n = rng.randint(1, 3)
                rid = f"t{step}"
                t = mg.create_block_table(rid)
                mg.prepare_append(t, rng.randint(1, 4 * n))
                if t.num_tokens >= 4:
                    nf = t.num_tokens // 4
                    mg.cache_full_blocks([mg.blocks[i] for i in t.block_ids],
                                         toks(4 * nf, base=rng.randint(0, 2) * 50), 0, nf)
                tables.append(rid)
            elif op == 3 and tables:
                src = rng.choice(tables)
                rid = f"f{step}"
                mg.fork_block_table(mg.get_block_table(src), rid)
                tables.append(rid)
                mg.prepare_append(mg.get_block_table(rid), rng.randint(0, 3))
            elif op == 4 and tables:
                mg.delete_block_table(tables.pop(rng.randrange(len(tables))))
            elif op == 5:
                got, _ = mg.acquire_computed_blocks(toks(8, base=rng.randint(0, 2) * 50))
                loose[id(mg)].extend(b.block_id for b in got)
            elif op == 6 and loose[id(mg)]:
                k = rng.randint(1, len(loose[id(mg)]))
                mg.free_block_batch(loose[id(mg)][:k])
                del loose[id(mg)][:k]
            elif op == 7:
                mg.evict_lru_blocks(rng.randint(0, 3))
        except OutOfBlocksError:
            pass
        assert stats_dict(m.get_stats()) == full_scan(m)
        assert stats_dict(other.get_stats()) == full_scan(m)
    assert m.check() == []
    held = len(loose[id(m)]) + len(loose[id(other)])
    assert sum(len(m.get_block_table(t)) for t in tables) + held + 1 == \
        sum(m._p.b_ref[b] for b in range(32))


def test_shared_blocks_stat_does_not_drift(manager):
    t, ids, _ = cached_table(manager, "a", 2)
    f = manager.fork_block_table(t, "b")
    assert manager.get_stats().shared_blocks == 2
    manager.delete_block_table("a")
    assert manager.get_stats().shared_blocks == 0
    manager.fork_block_table(f, "c")
    manager.fork_block_table(f, "d")
    assert manager.get_stats().shared_blocks == 2
    assert [manager.blocks[i].ref_count for i in ids] == [3, 3]
    for r in ("b", "c", "d"):
        manager.delete_block_table(r)
    assert stats_dict(manager.get_stats()) == full_scan(manager)
    assert manager.get_stats().allocated_blocks == 1


# ====================================================================== seed fixes
def test_fix_free_block_batch_reachable_and_free_blocks_property(manager):
    assert isinstance(type(manager).__dict__["free_blocks"], property)
    blocks = manager.get_new_blocks(4)
    assert manager.free_blocks == 27
    manager.free_block_batch(blocks[:3])
    assert manager.free_blocks == 30
    assert [b.ref_count for b in blocks] == [0, 0, 0, 1]
    manager.free_block_batch([blocks[3].block_id])        # ids work too
    assert manager.free_blocks == 31
    manager.free_block_batch([])
    assert manager.check() == []


def test_fix_free_block_batch_frees_in_order(manager):
    blocks = manager.get_new_blocks(3)
    manager.cache_full_blocks(blocks, toks(12), 0, 3)
    manager.free_block_batch([blocks[2], blocks[0], blocks[1]])
    assert manager.free_block_queue.ids()[-3:] == [blocks[2].block_id, blocks[0].block_id,
                                                   blocks[1].block_id]


def test_fix_tail_first_free(manager):
    t, ids, _ = cached_table(manager, "chain", 4)
    manager.delete_block_table("chain")
    q = manager.free_block_queue.ids()
    assert q[-4:] == ids[::-1]


def test_fix_find_shared_prefix_matches_whole_chains_only(manager):
    a, b, c = toks(4, 100), toks(4, 200), toks(4, 300)
    t = manager.create_block_table("ab")
    blocks = manager.get_new_blocks(2)
    for x in blocks:
        manager.add_block_to_table(t, x, 4)
    manager.cache_full_blocks(blocks, a + b, 0, 2)
    ids = [x.block_id for x in blocks]
    assert manager.find_shared_prefix(a + b + [1]) == (ids, [1])
    # b's tokens at position 0 (no parent) must not match the block cached after a
    assert manager.find_shared_prefix(b) == ([], b)
    assert manager.find_cached_block(b) is None
    assert manager.get_computed_blocks(b) == ([], 0)
    # ... nor after a different prefix
    t2 = manager.create_block_table("c")
    cb = manager.allocate_block()
    manager.add_block_to_table(t2, cb, 4)
    manager.cache_full_blocks([cb], c, 0, 1)
    assert manager.find_shared_prefix(c + b) == ([cb.block_id], b)
    got, n = manager.get_computed_blocks(c + b)
    assert [x.block_id for x in got] == [cb.block_id] and n == 4
    assert manager.find_cached_block(a + b).block_id == ids[1]
    assert manager.find_cached_block(a).block_id == ids[0]


def test_fix_register_block_hash_is_a_chain(manager):
    x = manager.allocate_block()
    manager.register_block_hash(x, toks(8))          # last block of the prefix 0..7
    assert manager.find_cached_block(toks(8)) == x
    assert manager.find_cached_block(toks(4, 4)) is None
    assert manager.check() == []


def test_fix_acquire_computed_blocks_takes_refs_atomically(make_pool):
    m = make_pool(block_size=4, max_blocks=8)
    t, ids, tokens = cached_table(m, "r", 3)
    m.delete_block_table("r")
    assert [m.blocks[i].ref_count for i in ids] == [0, 0, 0]
    hits = m.stats.cache_hits
    got, n = m.acquire_computed_blocks(tokens + [7])
    assert [b.block_id for b in got] == ids and n == 12
    assert [b.ref_count for b in got] == [1, 1, 1]
    assert m.stats.cache_hits == hits + 3
    assert not set(ids) & set(m.free_block_queue.ids())
    # not evictable: allocating everything else never takes them
    rest = m.get_new_blocks(m.free_blocks)
    assert not {b.block_id for b in rest} & set(ids)
    assert m.allocate_block() is None
    assert all(m.blocks[i].block_hash is not None for i in ids)
    # another manager sees them referenced and can share them
    other = shmcache.attach(m.name)
    try:
        og, on = other.acquire_computed_blocks(tokens)
        assert [b.block_id for b in og] == ids and [b.ref_count for b in og] == [2, 2, 2]
    finally:
        other.close()
    assert [m.blocks[i].ref_count for i in ids] == [1, 1, 1]
    # and they can go straight into a table
    t = m.create_block_table("again")
    for b in got:
        m.add_block_to_table(t, b, 4)
    assert t.block_ids == ids and m.check() == []


def test_get_computed_blocks_takes_no_reference(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    manager.delete_block_table("r")
    got, n = manager.get_computed_blocks(tokens)
    assert [b.block_id for b in got] == ids and n == 8
    assert [b.ref_count for b in got] == [0, 0]


def test_acquire_with_caching_disabled(make_pool):
    m = make_pool(enable_caching=False)
    b = m.allocate_block()
    m.cache_full_blocks([b], toks(4), 0, 1)
    assert b.block_hash is None
    assert m.acquire_computed_blocks(toks(4)) == ([], 0)
    assert m.get_computed_blocks(toks(4)) == ([], 0)
    assert m.find_shared_prefix(toks(6)) == ([], toks(6))
    assert m.get_cached_block(pc.BlockHash(b"x" * 16)) is None
    with pytest.raises(TypeError):
        m.acquire_computed_blocks(["x"])
    assert m.check() == []


def _prefill(m, rid, n_tokens, seed):
    """A table with n_tokens, K/V written per block; returns table and ids."""
    t = m.create_block_table(rid)
    blocks = m.prepare_append(t, n_tokens)
    for i, b in enumerate(blocks):
        for layer in range(m.layout.num_layers):
            k = kv_data(m, seed * 100 + i * 10 + layer)
            m.write_kv(b.block_id, layer, k, k * -1)
    return t, [b.block_id for b in blocks]


def test_fix_cow_copies_payload_bytes_and_only_the_last_block(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 6, seed=1)            # one full block + 2 tokens
    orig_payload = {b: payload(m, b) for b in ids}
    f = m.fork_block_table(t, "fork")
    assert [m.blocks[i].ref_count for i in ids] == [2, 2]
    out = m.prepare_append(f, 1)
    assert len(out) == 1
    copy = out[0].block_id
    assert copy not in ids
    assert f.block_ids == [ids[0], copy]               # the full block stays shared
    assert t.block_ids == ids
    assert m.blocks[ids[0]].ref_count == 2
    assert m.blocks[ids[1]].ref_count == 1 and m.blocks[copy].ref_count == 1
    assert payload(m, copy) == orig_payload[ids[1]]     # the bytes were copied
    assert m.blocks[copy].token_count == 3 and m.blocks[ids[1]].token_count == 2
    assert f.num_tokens == 7 and t.num_tokens == 6
    assert m.get_stats().cow_copies == 1
    # writing into the copy leaves the original alone
    m.write_kv(copy, 0, kv_data(m, 999, 1), kv_data(m, 998, 1), start=2)
    assert payload(m, ids[1]) == orig_payload[ids[1]]
    assert payload(m, copy) != orig_payload[ids[1]]
    assert payload(m, ids[0]) == orig_payload[ids[0]]
    k, _ = m.read_kv(f.block_ids, 0)
    ko, _ = m.read_kv(t.block_ids, 0)
    assert np.array_equal(np.array(k)[:, :6], np.array(ko)[:, :6])
    # the next step appends to the now private copy: no more copies
    assert m.prepare_append(f, 1)[0].block_id == copy
    assert m.get_stats().cow_copies == 1
    assert m.check() == []


def test_cow_not_needed_when_last_block_full(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 8, seed=2)
    f = m.fork_block_table(t, "fork")
    out = m.prepare_append(f, 1)
    assert len(out) == 1 and out[0].block_id not in ids
    assert f.block_ids == ids + [out[0].block_id]
    assert [m.blocks[i].ref_count for i in ids] == [2, 2]
    assert m.get_stats().cow_copies == 0


def test_cow_not_done_for_unshared_last_block(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 6, seed=3)
    assert [b.block_id for b in m.prepare_append(t, 1)] == [ids[1]]
    assert m.get_stats().cow_copies == 0


def test_fix_get_blocks_for_generation_copies_only_last_partial(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 10, seed=4)           # 2 full + 2 tokens
    before = payload(m, ids[2])
    f = m.fork_block_table(t, "fork")
    blocks, copied = m.get_blocks_for_generation(f)
    assert copied is True
    got = [b.block_id for b in blocks]
    assert got[:2] == ids[:2] and got[2] not in ids
    assert payload(m, got[2]) == before
    assert [m.blocks[i].ref_count for i in ids] == [2, 2, 1]
    blocks, copied = m.get_blocks_for_generation(f)
    assert copied is False and [b.block_id for b in blocks] == got
    # a fork whose last block is full copies nothing
    t2, ids2 = _prefill(m, "full", 4, seed=5)
    f2 = m.fork_block_table(t2, "full-fork")
    blocks, copied = m.get_blocks_for_generation(f2)
    assert copied is False and [b.block_id for b in blocks] == ids2
    assert m.check() == []


def test_fix_cow_copy_block_copies_payload(kvpool):
    m = kvpool
    src = m.allocate_block()
    m.write_kv(src.block_id, 1, kv_data(m, 1), kv_data(m, 2))
    src.token_count = 3
    new = m._cow_copy_block(src)
    assert new.block_id != src.block_id and new.ref_count == 1
    assert payload(m, new.block_id) == payload(m, src.block_id)
    assert new.token_count == 3
    m.write_kv(new.block_id, 1, kv_data(m, 3), kv_data(m, 4))
    assert payload(m, new.block_id) != payload(m, src.block_id)
    k, _ = m.read_kv([src.block_id], 1)
    assert np.array_equal(np.array(k), np.array(kv_data(m, 1)))
    assert m.get_stats().cow_copies == 1


def test_fix_evict_lru_blocks_keeps_order(manager):
    cached_table(manager, "a", 3)
    manager.delete_block_table("a")
    before = manager.free_block_queue.ids()
    assert manager.evict_lru_blocks(50) == 3
    assert manager.free_block_queue.ids() == before
    assert len(manager.hash_to_block) == 0
    assert manager.get_stats().evictions == 3


def test_fix_extra_keys_never_share_blocks(manager):
    tokens = toks(8)
    ta, ida, _ = cached_table(manager, "a", 2, extra_keys=("tenant-a",))
    assert manager.get_computed_blocks(tokens) == ([], 0)
    assert manager.get_computed_blocks(tokens, extra_keys=("tenant-b",)) == ([], 0)
    assert manager.acquire_computed_blocks(tokens, extra_keys=("tenant-b",)) == ([], 0)
    got, n = manager.get_computed_blocks(tokens, extra_keys=("tenant-a",))
    assert [b.block_id for b in got] == ida and n == 8
    tb, idb, _ = cached_table(manager, "b", 2, extra_keys=("tenant-b",))
    assert set(ida).isdisjoint(idb)
    assert {manager.blocks[i].block_hash for i in ida}.isdisjoint(
        {manager.blocks[i].block_hash for i in idb})
    got, _ = manager.acquire_computed_blocks(tokens, extra_keys=("tenant-b",))
    assert [b.block_id for b in got] == idb
    lora1 = cached_table(manager, "l1", 1, extra_keys=("lora", 1))[1]
    assert manager.get_computed_blocks(toks(4), extra_keys=("lora", 2)) == ([], 0)
    assert manager.get_computed_blocks(toks(4), extra_keys=("lora", 1))[0][0].block_id == lora1[0]
    assert manager.check() == []


def test_fix_per_pool_random_seed(make_pool):
    m1, m2 = make_pool(), make_pool()
    _, i1, tokens = cached_table(m1, "r", 2)
    _, i2, _ = cached_table(m2, "r", 2)
    h1 = [m1.blocks[i].block_hash for i in i1]
    h2 = [m2.blocks[i].block_hash for i in i2]
    assert h1[0] != h2[0] and h1[1] != h2[1]
    assert h1[0] != pc.compute_block_hash(None, tokens[:4])
    assert set(m1.hash_to_block).isdisjoint(m2.hash_to_block)
    assert m2.get_cached_block(h1[0]) is None
    # the seed is the pool's, so an attached manager hashes the same way
    other = shmcache.attach(m1.name)
    try:
        got, _ = other.get_computed_blocks(tokens)
        assert [b.block_id for b in got] == i1
    finally:
        other.close()


def test_get_cached_block_counts_hits_and_misses(manager):
    t, ids, _ = cached_table(manager, "r", 1)
    h = manager.blocks[ids[0]].block_hash
    assert manager.get_cached_block(h).block_id == ids[0]
    assert manager.get_cached_block(pc.BlockHash(b"\x01" * 16)) is None
    s = manager.get_stats()
    assert (s.cache_hits, s.cache_misses) == (1, 1)


def test_cache_full_blocks_incremental(manager):
    t = manager.create_block_table("r")
    tokens = toks(12)
    blocks = manager.prepare_append(t, 8)
    manager.cache_full_blocks(blocks, tokens, 0, 2)
    blocks += manager.prepare_append(t, 4)
    manager.cache_full_blocks(blocks, tokens, 2, 3)
    got, n = manager.get_computed_blocks(tokens)
    assert [b.block_id for b in got] == t.block_ids and n == 12
    # same result as caching all three at once in another pool's terms:
    manager.delete_block_table("r")
    got2, _ = manager.acquire_computed_blocks(tokens)
    assert [b.block_id for b in got2] == [b.block_id for b in got]


def test_reset_prefix_cache_and_clear(pair):
    m, other = pair
    t, ids, tokens = cached_table(m, "r", 2)
    assert m.reset_prefix_cache() is False               # blocks in use
    assert len(m.hash_to_block) == 2
    m.delete_block_table("r")
    assert m.reset_prefix_cache() is True
    assert len(m.hash_to_block) == 0 and m.get_computed_blocks(tokens)[0] == []
    cached_table(m, "r2", 2)
    other.get_new_blocks(3)
    other.create_block_table("o")
    m.clear()
    assert m.free_blocks == 31 and len(m.request_tables) == 0
    assert len(m.hash_to_block) == 0 and m.check() == []
    # the other manager notices its holdings are gone
    assert other.free_blocks == 31
    b = other.allocate_block()
    assert other.free_block(b.block_id) is True
    assert other.check() == []


# ====================================================================== tables
def test_block_table_lifecycle(manager):
    t = manager.create_block_table("r")
    assert isinstance(t, pc.BlockTable) and t.request_id == "r"
    assert manager.get_block_table("r") == t
    assert manager.get_or_create_block_table("r") == t
    n = manager.get_or_create_block_table("new")
    assert n.request_id == "new" and len(manager.request_tables) == 2
    b = manager.allocate_block()
    manager.add_block_to_table(t, b, 3)
    assert t.block_ids == [b.block_id] and t.num_tokens == 3 and b.token_count == 3
    assert b.ref_count == 1                      # the reference moved into the table
    with pytest.raises(ValueError):
        manager.free_block(b.block_id)           # held by the table, not loose
    manager.delete_block_table("r")
    assert b.ref_count == 0 and manager.get_block_table("r") is None
    assert manager.check() == []


def test_fork_shares_blocks(manager):
    t, ids, _ = cached_table(manager, "a", 2)
    f = manager.fork_block_table(t, "b")
    assert f.block_ids == ids and f.num_tokens == 8
    assert [manager.blocks[i].ref_count for i in ids] == [2, 2]
    manager.delete_block_table("a")
    assert [manager.blocks[i].ref_count for i in ids] == [1, 1]
    assert manager.get_block_table("b").block_ids == ids
    manager.delete_block_table("b")
    assert manager.free_blocks == 31 and manager.check() == []


def test_prepare_append_counts(manager):
    t = manager.create_block_table("r")
    out = manager.prepare_append(t, 5)
    assert len(out) == 2 and [b.token_count for b in out] == [4, 1]
    assert t.num_tokens == 5 and len(t) == 2 and t.block_ids == [b.block_id for b in out]
    assert manager.free_blocks == 29
    out2 = manager.prepare_append(t, 3)
    assert [b.block_id for b in out2] == [out[1].block_id] and out2[0].token_count == 4
    assert t.num_tokens == 8 and len(t) == 2 and manager.free_blocks == 29
    assert manager.prepare_append(t, 0) == []
    assert t.num_tokens == 8
    out3 = manager.prepare_append(t, 9)
    assert len(out3) == 3 and [b.token_count for b in out3] == [4, 4, 1]
    assert t.num_tokens == 17 and len(t) == 5 and manager.free_blocks == 26
    out4 = manager.prepare_append(t, 1)
    assert [b.block_id for b in out4] == [out3[2].block_id] and out4[0].token_count == 2
    assert manager.check() == []


def test_can_append(make_pool):
    m = make_pool(block_size=4, max_blocks=5)        # 4 usable
    t = m.create_block_table("r")
    assert m.can_append(t, 16) and not m.can_append(t, 17)
    m.prepare_append(t, 6)
    assert m.can_append(t, 2 + 8) and not m.can_append(t, 2 + 8 + 1)
    assert m.can_append(t, 0)
    # a shared partial last block needs one more block for its copy
    f = m.fork_block_table(t, "f")
    assert m.can_append(f, 1 + 4) and not m.can_append(f, 1 + 8)
    assert m.free_blocks == 2


def test_prepare_append_out_of_blocks_leaves_pool_unchanged(make_pool):
    m = make_pool(block_size=4, max_blocks=5)
    t = m.create_block_table("r")
    m.prepare_append(t, 6)
    f = m.fork_block_table(t, "f")
    before = snapshot(m)
    assert not m.can_append(t, 11)
    with pytest.raises(OutOfBlocksError):
        m.prepare_append(t, 11)
    unchanged(m, before)
    m.get_new_blocks(2)
    before = snapshot(m)
    assert not m.can_append(f, 1)                     # its COW needs a block
    with pytest.raises(OutOfBlocksError):
        m.prepare_append(f, 1)
    unchanged(m, before)
    assert not m.can_append(t, 1)                     # t's last block is shared too
    assert m.can_append(t, 0)


def test_prepare_append_accepts_request_id(manager):
    manager.create_block_table("r")
    out = manager.prepare_append("r", 2)
    assert len(out) == 1 and manager.get_block_table("r").num_tokens == 2


# ====================================================================== check()
def _scenario(m):
    t, ids, tokens = cached_table(m, "a", 3)
    f = m.fork_block_table(t, "b")
    m.prepare_append(f, 2)
    got, _ = m.acquire_computed_blocks(tokens)
    m.get_new_blocks(2)
    m.create_block_table("empty")
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
    "table tail": lambda m, p: p.t_tail.__setitem__(_live_table(p), p.t_head[_live_table(p)]),
    "loose count": lambda m, p: p.s_count.__setitem__(p.slot, p.s_count[p.slot] + 1),
    "leaked record": lambda m, p: p.r_block.__setitem__(_free_record(p), 3),
    "free record counter": lambda m, p: p.c.__setitem__(L.C_FREE_REFS, p.c[L.C_FREE_REFS] - 1),
    "record in two lists": lambda m, p: p.r_next.__setitem__(
        p.t_tail[_live_table(p)], p.s_head[p.slot]),
    "cyclic table list": lambda m, p: p.r_next.__setitem__(
        p.t_tail[_live_table(p)], p.t_head[_live_table(p)]),
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


def _free_record(p):
    return int(p.c[L.C_FREE_REF])


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_check_detects_corruption(manager, kind):
    _scenario(manager)
    assert manager.check() == []
    p = manager._p
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
    manager._p.b_ref[5] = 7
    problems = manager.check()
    assert any("block 5" in s and "ref_count" in s for s in problems)
    manager._p.b_ref[5] = 1
    assert manager.check() == []


# ====================================================================== close()
def test_close_releases_everything_the_manager_held(pair):
    m, other = pair
    mine = m.allocate_block()
    t_mine, _, tokens = cached_table(m, "mine", 2)
    loose = other.get_new_blocks(3)
    ot = other.create_block_table("theirs")
    for b in other.get_new_blocks(2):
        other.add_block_to_table(ot, b, 4)
    other.fork_block_table(t_mine, "their-fork")
    acquired, _ = other.acquire_computed_blocks(tokens)
    other.create_block_table("empty")
    assert m.free_blocks == 31 - 1 - 2 - 3 - 2
    other.close()
    assert m.free_blocks == 31 - 1 - 2
    assert set(m.request_tables) == {"mine"}
    assert [m.blocks[i].ref_count for i in t_mine.block_ids] == [1, 1]
    assert mine.ref_count == 1
    assert all(m.blocks[b.block_id].ref_count == 0 for b in loose)
    assert m.check() == []
    assert m.reclaim_dead() == 0
    other.close()                                          # twice is fine
    with pytest.raises(PoolClosedError):
        other.allocate_block()
    with pytest.raises(PoolClosedError):
        other.get_block_table("mine")
    with pytest.raises(PoolClosedError):
        other.check()
    assert m.check() == []


def test_close_frees_its_slot(make_pool):
    m = make_pool(max_slots=2)
    for _ in range(5):
        o = shmcache.attach(m.name)
        o.allocate_block()
        o.close()
    assert m.free_blocks == 31
    assert len(m.holdings()) == 1


def test_holdings(pair):
    m, other = pair
    other.get_new_blocks(2)
    t = other.create_block_table("x")
    other.add_block_to_table(t, other.allocate_block(), 1)
    h = {d["slot"]: d for d in m.holdings()}
    mine = h[other._p.slot]
    assert mine["pid"] == os.getpid() and mine["alive"]
    assert (mine["tables"], mine["table_blocks"], mine["loose_blocks"]) == (1, 1, 2)


def test_repair_after_manager_collected_while_pool_dirty(make_pool):
    m = make_pool()
    other = shmcache.attach(m.name)
    other.get_new_blocks(3)
    m._p.c[L.C_DIRTY] = 1           # as if a holder had died mid-update
    del other
    gc.collect()                    # its finalizer repairs, then releases
    assert m._p.c[L.C_RECOVERIES] == 1
    assert m._p.c[L.C_DIRTY] == 0
    assert m.free_blocks == 31
    assert m.check() == []


def test_creator_context_manager_destroys(pool_name):
    path = f"/dev/shm/shmcache.{pool_name}"
    with shmcache.create_pool(pool_name, block_size=4, max_blocks=8) as m:
        m.allocate_block()
        assert os.path.exists(path)
    assert not os.path.exists(path)


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


def test_add_block_not_held(pair):
    m, other = pair
    t = m.create_block_table("r")
    b = other.allocate_block()
    before = snapshot(m)
    with pytest.raises(ValueError):
        m.add_block_to_table(t, b, 1)               # another manager's block
    with pytest.raises(ValueError):
        m.add_block_to_table(t, 9, 1)               # a free block
    assert snapshot(m)[2] == before[2] and m.check() == []


@pytest.mark.parametrize("kw", [dict(block_size=0), dict(block_size=-4), dict(max_blocks=0),
                                dict(max_blocks=1), dict(max_blocks=-5), dict(block_size=2.0),
                                dict(max_blocks="10"), dict(block_size=True)])
def test_bad_manager_sizes(kw):
    with pytest.raises((TypeError, ValueError)):
        pc.PagedCacheManager(**kw)


@pytest.mark.parametrize("kw", [dict(num_kv_heads=0), dict(head_dim=0), dict(head_dim=-1),
                                dict(num_layers=-1), dict(max_slots=0), dict(max_tables=0),
                                dict(max_refs=0), dict(dtype="int8"), dict(block_size=0),
                                dict(max_blocks=1)])
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

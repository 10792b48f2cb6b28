"""The seed API (shmcache.manager.paged_cache) over private and named pools: the
public surface and signatures, the manager's attributes, stats, and
copy-on-write on a shared block that is not a table's last.

The seed's fixed bugs are in test_seed_fixes.py, allocation, block tables
and close() in test_tables.py, check() in test_check.py and bad input in
test_bad_input.py; prefix caching is in test_prefix.py, the live views in
test_views.py and the seed's containers in test_seed_views.py; their shared
helpers are in _helpers.py."""

from __future__ import annotations

import ast
import inspect
import random

import pytest

from shmcache.manager import paged_cache as pc
from shmcache.errors import OutOfBlocksError

from _helpers import cached_table, full_scan, stats_dict, toks
from _helpers import pair as pair  # pytest fixtures

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


def test_get_memory_usage(manager):
    manager.get_new_blocks(3)
    u = manager.get_memory_usage()
    for k in ("block_size", "max_blocks", "allocated_blocks", "free_blocks", "shared_blocks",
              "total_tokens_cached", "utilization", "cache_hit_rate"):
        assert k in u
    assert u["allocated_blocks"] == 4 and u["free_blocks"] == 28
    assert u["utilization"] == 4 / 32


# ====================================================================== stats
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
        sum(m.pool.b_ref[b] for b in range(32))


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


# ====================================================================== copy-on-write
def test_prepare_append_copies_a_shared_block_that_is_not_the_last(manager):
    """Regression (review of the core library; prepare_append is in
    shmcache/manager/tables.py): a partly filled shared block followed by a pre-added
    empty block: the new token lands in the shared one, which must be
    copied, not written in place."""
    t = manager.create_block_table("a")
    (a,) = manager.prepare_append(t, 2)
    f = manager.fork_block_table(t, "b")
    manager.add_block_to_table(f, manager.allocate_block(), 0)
    out = manager.prepare_append(f, 1)
    assert out[0].block_id != a.block_id
    assert manager.get_block_table("a").block_ids == [a.block_id]
    assert a.ref_count == 1 and out[0].ref_count == 1 and out[0].token_count == 3
    assert manager.check() == []

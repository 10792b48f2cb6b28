"""The seed API's plain value types, with the seed's names and behaviour.

These are what code written for ``vllm_mlx.paged_cache`` builds directly
(``CacheBlock(block_id=3)``, ``BlockTable("r1")``, a standalone
``FreeKVCacheBlockQueue``). A manager hands out live views instead
(``shmcache.manager.views``), which subclass these so ``isinstance`` still holds.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NewType, Optional, Tuple

import numpy as np

from .layout import HASH_BYTES

BlockHash = NewType("BlockHash", bytes)

ROOT_SEED = b"shmcache-root-v1"


def token_bytes(token_ids) -> bytes:
    """Token ids as little-endian uint32 bytes, validated in one pass."""
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError):
        raise TypeError("token ids must be a sequence of ints") from None
    if arr.ndim != 1:
        if arr.size == 0:
            return b""
        raise TypeError(f"token ids must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        bad = next((t for t in token_ids if isinstance(t, bool) or not hasattr(t, "__index__")), None)
        raise TypeError(f"token ids must be ints, got {type(bad).__name__} ({bad!r})")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= 2**32:
        raise ValueError(f"token ids must be in [0, 2**32), got {lo if lo < 0 else hi}")
    return arr.astype("<u4").tobytes()


def chain_hash(root: bytes, parent: Optional[bytes], data: bytes, extra: bytes) -> bytes:
    h = hashlib.blake2b(parent or root, digest_size=HASH_BYTES)
    h.update(data)
    if extra:
        h.update(b"\x00extra\x00")
        h.update(extra)
    return h.digest()


def chain_hashes(root: bytes, block_size: int, token_ids, n_blocks: int, extra_keys=None,
                 parent: Optional[bytes] = None, start: int = 0) -> List[bytes]:
    """Chain hashes of blocks ``start .. n_blocks-1`` of ``token_ids``.

    Block i's hash covers its parent's (``parent`` for block ``start``, the
    pool's ``root`` at the first block), its ``block_size`` tokens and the
    ``extra_keys`` salt. Raises as ``token_bytes``.
    """
    data = token_bytes(token_ids)
    extra = extra_bytes(extra_keys)
    step = 4 * block_size
    out = []
    h = parent
    if extra:
        for i in range(start, n_blocks):
            h = chain_hash(root, h, data[i * step:(i + 1) * step], extra)
            out.append(h)
        return out
    h = h or root
    blake2b = hashlib.blake2b
    for i in range(start * step, n_blocks * step, step):   # chain_hash, inlined: the hot loop
        d = blake2b(h, digest_size=HASH_BYTES)
        d.update(data[i:i + step])
        h = d.digest()
        out.append(h)
    return out


def extra_bytes(extra_keys) -> bytes:
    if not extra_keys:
        return b""
    return repr(tuple(extra_keys)).encode()


def compute_block_hash(parent_hash: Optional[BlockHash], token_ids: List[int],
                       extra_keys: Optional[Tuple[Any, ...]] = None) -> BlockHash:
    """Chain hash of one block: depends on its parent's hash, its tokens and
    ``extra_keys`` (a tenant salt, a LoRA id, ...).

    A manager hashes with its pool's own random root instead of the fixed root
    used here, so hashes of different pools never collide by construction.

    Raises:
        TypeError, ValueError: a token id is not a non-negative int.
    """
    return BlockHash(chain_hash(ROOT_SEED, parent_hash, token_bytes(token_ids),
                                extra_bytes(extra_keys)))


@dataclass
class CacheBlock:
    """Metadata of one KV block (the seed's dataclass).

    ``ref_count`` 0 means free (evictable); ``block_hash`` is set while the
    block is in the prefix cache.
    """

    block_id: int
    ref_count: int = 0
    block_hash: Optional[BlockHash] = None
    prev_free_block: Optional["CacheBlock"] = None
    next_free_block: Optional["CacheBlock"] = None
    is_null: bool = False
    cache_data: Optional[List[Tuple[Any, Any]]] = None
    token_count: int = 0
    hash_value: Optional[str] = None
    last_access: float = field(default_factory=time.time)

    def is_full(self, block_size: int) -> bool:
        return self.token_count >= block_size

    def is_shared(self) -> bool:
        return self.ref_count > 1

    def reset_hash(self) -> None:
        self.block_hash = None
        self.hash_value = None

    def touch(self) -> None:
        self.last_access = time.time()

    def __repr__(self) -> str:
        p, n = self.prev_free_block, self.next_free_block
        return (f"CacheBlock(id={self.block_id}, ref={self.ref_count}, "
                f"tokens={self.token_count}, prev={p.block_id if p else None}, "
                f"next={n.block_id if n else None})")


KVCacheBlock = CacheBlock


class FreeKVCacheBlockQueue:
    """Doubly linked LRU list of plain ``CacheBlock`` objects (the seed's class).

    Front is least recently used. ``fake_head``/``fake_tail`` are sentinels
    that are never popped, so no operation branches on the list's ends.
    A manager's own queue is ``shmcache.shm.freelist.SharedFreeQueue``.
    """

    def __init__(self, blocks: List[CacheBlock]) -> None:
        self.fake_head = CacheBlock(block_id=-1)
        self.fake_tail = CacheBlock(block_id=-2)
        self.fake_head.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = self.fake_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> CacheBlock:
        if self.fake_head.next_free_block is self.fake_tail:
            raise ValueError("No free blocks available")
        block = self.fake_head.next_free_block
        assert block is not None                 # (the sentinels are always linked)
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> List[CacheBlock]:
        if n > self.num_free_blocks:
            raise AssertionError(f"Need {n} blocks, have {self.num_free_blocks}")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: CacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"Block {block.block_id} not in free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: CacheBlock) -> None:
        last = self.fake_tail.prev_free_block
        assert last is not None                  # (the sentinels are always linked)
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: List[CacheBlock]) -> None:
        for b in blocks:
            self.append(b)

    def get_all_free_blocks(self) -> List[CacheBlock]:
        out, cur = [], self.fake_head.next_free_block
        while cur is not None and cur is not self.fake_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


class BlockHashToBlockMap:
    """Chain hash -> blocks (several blocks may share one hash), the seed's class."""

    def __init__(self) -> None:
        self._cache: Dict[BlockHash, Dict[int, CacheBlock]] = {}

    def get_block(self, block_hash: BlockHash) -> Optional[CacheBlock]:
        blocks = self._cache.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def insert(self, block_hash: BlockHash, block: CacheBlock) -> None:
        self._cache.setdefault(block_hash, {})[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> Optional[CacheBlock]:
        blocks = self._cache.get(block_hash)
        if not blocks:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[block_hash]
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()


@dataclass
class BlockTable:
    """Logical -> physical block mapping of one request (the seed's dataclass)."""

    request_id: str
    block_ids: List[int] = field(default_factory=list)
    num_tokens: int = 0

    def add_block(self, block_id: int, num_tokens: int) -> None:
        self.block_ids.append(block_id)
        self.num_tokens += num_tokens

    def __len__(self) -> int:
        return len(self.block_ids)

    def copy(self, new_request_id: str) -> "BlockTable":
        return BlockTable(new_request_id, list(self.block_ids), self.num_tokens)


@dataclass
class CacheStats:
    """Statistics of a pool (a snapshot when returned by ``get_stats``)."""

    total_blocks: int = 0
    allocated_blocks: int = 0
    free_blocks: int = 0
    shared_blocks: int = 0
    total_tokens_cached: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cow_copies: int = 0
    evictions: int = 0


@dataclass
class PoolStats(CacheStats):
    """What ``get_stats`` returns for a pool: the seed's ``CacheStats``, and
    the pool's capacities beside them.

    ``refs_held`` of ``max_refs``: the block references the tables and the
    managers' loose lists hold, and how many they can hold (however they
    are spread: a reference costs 4 bytes, so forks and shared prefixes
    cost next to nothing); ``block_tables`` of ``max_tables``;
    ``attached`` managers of ``max_slots``; ``cached_blocks``: blocks in
    the prefix cache (referenced or not); ``tokens_held``: the token counts
    of the referenced blocks, each block once (``total_tokens_cached`` is
    the seed's running count: tokens added to tables, less the tokens of
    each block that goes back to the free queue, so a block added to two
    tables counts twice)."""

    tokens_held: int = 0
    cached_blocks: int = 0
    refs_held: int = 0
    max_refs: int = 0
    block_tables: int = 0
    max_tables: int = 0
    attached: int = 0
    max_slots: int = 0

    CAPACITY = ("tokens_held", "cached_blocks", "refs_held", "max_refs", "block_tables",
                "max_tables", "attached", "max_slots")

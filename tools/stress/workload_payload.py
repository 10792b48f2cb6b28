"""The K/V payload a workload writes, so that any reader knows its bytes.

Used by :mod:`tools.stress.workload_driver` (the random workload of the stress
tool's workers and of the tests' workers) and by the tests that check what
a worker wrote. Two patterns, both exact in float32 (integers below 2**24):

* a block of a request's chain holds, at each token position, a value
  derived from the chain of token ids before its block, the request's extra
  keys, the token there and its offset in the block: every publisher of the
  same chain writes the same bytes, and a block found under another chain
  (or another tenant's extra keys) reads as wrong;
* a private block (allocated, not in a table) holds a value derived from a
  key its writer chose, e.g. from (pid, block id, a counter).

Both need a float32 pool.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Optional

import numpy as np

M24 = 1 << 24            # payload values are integers < 2**24: exact in float32


def extra_for(salt: int):
    """The extra keys of salt ``salt``: none for 0, a tenant otherwise."""
    return None if salt == 0 else ("tenant", salt)


def private_key(*parts) -> int:
    """A private block's pattern key from any parts (e.g. pid, block id, a counter)."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % M24


class Pattern:
    """Expected K/V contents of a pool of one shape, for writers and readers.

    Args:
        block_size, num_layers, num_kv_heads, head_dim: the pool's shape.
    """

    def __init__(self, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.bs = block_size
        n = num_layers * 2 * num_kv_heads * head_dim
        self.off = (np.arange(n, dtype=np.int64) * 65537 % M24).reshape(
            num_layers, 2, num_kv_heads, head_dim)

    def chain_keys(self, tokens, extra) -> list:
        """One key per block of ``tokens``, from the chain of token ids before it."""
        h = hashlib.blake2b(repr(extra).encode(), digest_size=16).digest()
        out = []
        for i in range(-(-len(tokens) // self.bs)):
            out.append(int.from_bytes(h[:8], "little") % M24)
            blk = np.asarray(tokens[i * self.bs:(i + 1) * self.bs], dtype="<u4").tobytes()
            h = hashlib.blake2b(h + blk, digest_size=16).digest()
        return out

    def chain_seeds(self, tokens, extra, a: int, b: int) -> np.ndarray:
        """Per-position seeds of positions [a, b) of the chain ``tokens``."""
        keys = np.asarray(self.chain_keys(tokens[:b], extra), dtype=np.int64)
        pos = np.arange(a, b)
        tok = np.asarray(tokens[a:b], dtype=np.int64)
        return (keys[pos // self.bs] + tok * 40503 + (pos % self.bs) * 9973) % M24

    def private_seeds(self, key: int) -> np.ndarray:
        """Per-position seeds of a whole private block of key ``key``."""
        return (key + np.arange(self.bs, dtype=np.int64) * 40503) % M24

    def arrays(self, seeds: np.ndarray, layer: int):
        """(K, V) of ``seeds`` in ``layer``, float32 numpy arrays # (H, len(seeds), D)."""
        o = self.off[layer]
        k = (seeds[None, :, None] + o[0][:, None, :]) % M24
        v = (seeds[None, :, None] + o[1][:, None, :]) % M24
        return k.astype(np.float32), v.astype(np.float32)


@functools.lru_cache(maxsize=16)
def _pattern_of(bs: int, layers: int, heads: int, dim: int) -> Pattern:
    return Pattern(bs, layers, heads, dim)


def pattern_for(mgr) -> Pattern:
    """The (cached) pattern of ``mgr``'s pool shape."""
    lay = mgr.layout
    return _pattern_of(lay.block_size, lay.num_layers, lay.num_kv_heads, lay.head_dim)


def write_chain(mgr, ids, tokens, extra, a: int, b: int, first_block: int = 0,
                convert=None) -> int:
    """Write the pattern of positions [a, b) of the chain ``tokens`` (extra
    keys ``extra``) into blocks ``ids``, where ``ids[i]`` holds block
    ``first_block + i`` of the chain.

    Args:
        convert: applied to each K and V array before ``write_kv`` (e.g.
            ``mx.array``); None writes numpy arrays.

    Returns:
        The number of ``write_kv`` calls made.
    """
    pat, bs = pattern_for(mgr), mgr.block_size
    seeds = pat.chain_seeds(tokens, extra, a, b)
    calls = 0
    for layer in range(mgr.layout.num_layers):
        k, v = pat.arrays(seeds, layer)
        p = a
        while p < b:
            i, j = divmod(p, bs)
            e = min(b, (i + 1) * bs)
            ks, vs = k[:, p - a:e - a, :], v[:, p - a:e - a, :]
            if convert is not None:
                ks, vs = convert(ks), convert(vs)
            mgr.write_kv(ids[i - first_block], layer, ks, vs, start=j)
            calls += 1
            p = e
    return calls


def chain_mismatch(mgr, ids, tokens, extra, n: int, layers=None) -> Optional[str]:
    """Where the first ``n`` positions of blocks ``ids`` differ from the
    pattern of the chain ``tokens``; None when they all match.

    Args:
        layers: the layers to read (default: every layer).

    Returns:
        None, or a description naming the first wrong block, its index, the
        position in it and the layer.
    """
    if n <= 0:
        return None
    pat, bs = pattern_for(mgr), mgr.block_size
    ids = list(ids)[:-(-n // bs)]
    seeds = pat.chain_seeds(tokens, extra, 0, n)
    for layer in (range(mgr.layout.num_layers) if layers is None else layers):
        k, v = mgr.read_kv(ids, layer)
        k, v = np.array(k)[:, :n, :], np.array(v)[:, :n, :]
        ek, ev = pat.arrays(seeds, layer)
        bad = np.flatnonzero(((k != ek) | (v != ev)).any(axis=(0, 2)))
        if bad.size:
            pos = int(bad[0])
            return (f"block {ids[pos // bs]} (index {pos // bs}) position {pos % bs} "
                    f"layer {layer}: {bad.size} tokens differ")
    return None


def write_private(mgr, block_id: int, key: int, convert=None) -> None:
    """Write the private pattern of ``key`` into every position of a block."""
    pat = pattern_for(mgr)
    seeds = pat.private_seeds(key)
    for layer in range(mgr.layout.num_layers):
        k, v = pat.arrays(seeds, layer)
        if convert is not None:
            k, v = convert(k), convert(v)
        mgr.write_kv(block_id, layer, k, v)


def private_mismatch(mgr, block_id: int, key: int, layers=None) -> Optional[str]:
    """A description of the first layer where a block differs from the
    private pattern of ``key``; None when it matches."""
    pat = pattern_for(mgr)
    seeds = pat.private_seeds(key)
    for layer in (range(mgr.layout.num_layers) if layers is None else layers):
        k, v = mgr.read_kv([block_id], layer)
        ek, ev = pat.arrays(seeds, layer)
        if not (np.array_equal(np.array(k), ek) and np.array_equal(np.array(v), ev)):
            return f"private block {block_id} layer {layer} does not hold its writer's bytes"
    return None

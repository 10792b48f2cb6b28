"""L2 keys and values: what a block's payload is, its chain key, its checked value.

* :class:`KVLayout` and :func:`fingerprint`: what a block's payload is (model
  identity, dtype, block size, layers, KV heads, head dim, how a block is cut
  into values). Two pools whose fingerprints differ never share an entry.
* :class:`Codec`: chain keys and values. A block's chain hash is
  ``blake2b(key=K, parent || tokens of the block || salt)``, the parent of
  block 0 being the fingerprint, ``K`` derived from the cluster secret. The
  Redis key is ``shmcache:kv1:<fingerprint>:<chain hash>[:c<chunk>]``. A
  value is a fixed header (magic, format version, fingerprint, chain hash,
  chunk, layers, payload length, MAC) followed by the payload: for each layer
  of the chunk, K then V, each (heads, block_size, head_dim), in the pool's
  storage dtype (bfloat16 as its raw 16-bit words), little-endian: exactly
  the bytes of ``PagedCacheManager.export_blocks``. The MAC is a keyed
  blake2b-128 (key derived from the secret) of the header and payload: it is
  the checksum, and only a holder of the secret can make a value for a key.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ..shm.layout import KV_DTYPES, kv_block_bytes

FORMAT_VERSION = 1
KEY_PREFIX = b"shmcache:kv1:"
MAGIC = b"SHMCKV"
DEFAULT_MAX_VALUE = 4 << 20             # a block larger than this is cut into layer chunks

# header: magic, version, flags, fingerprint, chain hash, chunk, chunks,
# first layer, end layer, payload bytes, MAC
_HDR = struct.Struct("<6sBB16s16sHHHHQ16s")
HEADER_BYTES = _HDR.size
_MAC_OFF = HEADER_BYTES - 16


class Rejected(ValueError):
    """A value that failed a check (the reason is the message)."""


@dataclass(frozen=True)
class KVLayout:
    """What one block's payload is."""
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, mgr, model_id: str) -> "KVLayout":
        """The layout of a manager's pool, for the model ``model_id``."""
        lay = mgr.layout
        return cls(model_id, lay.dtype, mgr.block_size, lay.num_layers, lay.num_kv_heads,
                   lay.head_dim)

    @property
    def np_dtype(self) -> np.dtype:
        return KV_DTYPES[self.dtype].np_dtype

    @property
    def layer_bytes(self) -> int:
        """K and V of one layer of one block."""
        return kv_block_bytes(1, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)

    @property
    def block_bytes(self) -> int:
        """K and V of every layer of one block (a pool's ``Layout.block_bytes``)."""
        return kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim,
                              self.block_size, self.dtype)


def fingerprint(layout: KVLayout, chunk_layers: int) -> bytes:
    """16 bytes naming the model and the payload layout (not secret)."""
    desc = dict(format=FORMAT_VERSION, model=layout.model_id, dtype=layout.dtype,
                block_size=layout.block_size, layers=layout.num_layers,
                kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                chunk_layers=chunk_layers, byteorder="little")
    return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16,
                           person=b"shmcache-l2-fp").digest()


def _salt_bytes(extra_keys) -> bytes:
    if not extra_keys:
        return b""
    s = repr(tuple(extra_keys)).encode()
    return b"\x00salt\x00" + len(s).to_bytes(4, "little") + s


def _token_bytes(tokens) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


class Codec:
    """Chain keys and values of one layout under one secret.

    Args:
        layout: the payload's layout.
        secret: the cluster secret (any bytes; pools share L2 entries only
            when their secrets are equal).
        max_value_bytes: a block whose payload is larger is cut into chunks
            of whole layers, each its own value (``<key>:c<j>``).
    Raises:
        ValueError: an empty secret.
        RuntimeError: a big-endian host (the format is little-endian).
    """

    def __init__(self, layout: KVLayout, secret: bytes, max_value_bytes: int = DEFAULT_MAX_VALUE):
        if sys.byteorder != "little":
            raise RuntimeError("the L2 format is little-endian; this host is not")
        if not secret:
            raise ValueError("the L2 secret must not be empty")
        self.layout = layout
        lb = layout.layer_bytes
        L = layout.num_layers
        self.chunk_layers = L if lb * L <= max_value_bytes else max(1, max_value_bytes // lb)
        self.chunks = [(lo, min(L, lo + self.chunk_layers)) for lo in range(0, L, self.chunk_layers)]
        self.fp = fingerprint(layout, self.chunk_layers)
        self._prefix = KEY_PREFIX + self.fp.hex().encode() + b":"
        self._chain_key = hashlib.blake2b(secret, digest_size=32, person=b"shmcache-l2-key").digest()
        self._mac_key = hashlib.blake2b(secret, digest_size=32, person=b"shmcache-l2-mac").digest()

    # ----------------------------------------------------------- keys
    def chain(self, tokens: Sequence[int], n_blocks: int, extra_keys=None,
              prev: Optional[List[bytes]] = None) -> List[bytes]:
        """Chain hashes of the first ``n_blocks`` full blocks of ``tokens``.

        Args:
            tokens: token ids, at least ``n_blocks * block_size``.
            n_blocks: blocks to hash.
            extra_keys: the tenant salt (as ``cache_full_blocks`` takes it).
            prev: the hashes of the first blocks, already computed (extended,
                not recomputed).
        Returns:
            ``n_blocks`` 16-byte hashes.
        Raises:
            ValueError: too few tokens, or a token id outside [0, 2**32).
        """
        out = list(prev or [])
        if n_blocks <= len(out):
            return out[:n_blocks]
        bs = self.layout.block_size
        start = len(out)
        data = _token_bytes(tokens[start * bs:n_blocks * bs])
        if len(data) < (n_blocks - start) * bs * 4:
            raise ValueError(f"{n_blocks} blocks need {n_blocks * bs} tokens, got {len(tokens)}")
        salt = _salt_bytes(extra_keys)
        step = 4 * bs
        h = out[-1] if out else self.fp
        for i in range(n_blocks - start):
            d = hashlib.blake2b(h, digest_size=16, key=self._chain_key)
            d.update(data[i * step:(i + 1) * step])
            if salt:
                d.update(salt)
            h = d.digest()
            out.append(h)
        return out

    def keys(self, chain_hash: bytes) -> List[bytes]:
        """The Redis keys of one block's values (one per chunk)."""
        base = self._prefix + chain_hash.hex().encode()
        if len(self.chunks) == 1:
            return [base]
        return [base + b":c%d" % j for j in range(len(self.chunks))]

    # --------------------------------------------------------- values
    def encode(self, chain_hash: bytes, chunk: int, payload) -> bytes:
        """The value of one chunk of one block: header, MAC, payload."""
        lo, hi = self.chunks[chunk]
        payload = memoryview(payload).cast("B")
        hdr = _HDR.pack(MAGIC, FORMAT_VERSION, 0, self.fp, chain_hash, chunk, len(self.chunks),
                        lo, hi, len(payload), bytes(16))
        mac = hashlib.blake2b(hdr[:_MAC_OFF], digest_size=16, key=self._mac_key)
        mac.update(payload)
        return b"".join((hdr[:_MAC_OFF], mac.digest(), payload))

    def decode(self, value, chain_hash: bytes, chunk: int) -> memoryview:
        """The payload of a value read for (chain_hash, chunk).

        Raises:
            Rejected: a header field or the MAC does not check out.
        """
        v = memoryview(value)
        if len(v) < HEADER_BYTES:
            raise Rejected(f"truncated header ({len(v)} bytes)")
        magic, ver, _flags, fp, ch, j, n, lo, hi, plen, mac = _HDR.unpack_from(v)
        if magic != MAGIC:
            raise Rejected("not a shmcache value (bad magic)")
        if ver != FORMAT_VERSION:
            raise Rejected(f"format version {ver}, not {FORMAT_VERSION}")
        if fp != self.fp:
            raise Rejected("another layout's fingerprint")
        if ch != chain_hash:
            raise Rejected("another block's chain hash")
        want_lo, want_hi = self.chunks[chunk]
        if (j, n, lo, hi) != (chunk, len(self.chunks), want_lo, want_hi):
            raise Rejected(f"chunk {j}/{n} layers {lo}..{hi}, expected {chunk}/{len(self.chunks)} "
                           f"layers {want_lo}..{want_hi}")
        want = (want_hi - want_lo) * self.layout.layer_bytes
        if plen != want:
            raise Rejected(f"payload length {plen} in the header, expected {want}")
        if len(v) != HEADER_BYTES + plen:
            raise Rejected(f"value of {len(v)} bytes, the header says {HEADER_BYTES + plen}")
        d = hashlib.blake2b(v[:_MAC_OFF], digest_size=16, key=self._mac_key)
        d.update(v[HEADER_BYTES:])
        if d.digest() != mac:
            raise Rejected("checksum mismatch")
        return v[HEADER_BYTES:]

    def chunk_array(self, payload, chunk: int) -> np.ndarray:
        """A chunk's payload as ``# (layers, 2, H, T, D)`` (a view)."""
        lo, hi = self.chunks[chunk]
        lay = self.layout
        return np.frombuffer(payload, lay.np_dtype).reshape(
            hi - lo, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)

    def blocks_array(self, payloads: List[List[memoryview]]) -> np.ndarray:
        """Decoded payloads of n blocks (each a list of its chunks) as one
        ``# (L, n, 2, H, T, D)`` array, what ``import_blocks`` takes."""
        lay = self.layout
        out = np.empty((lay.num_layers, len(payloads), 2, lay.num_kv_heads, lay.block_size,
                        lay.head_dim), lay.np_dtype)
        for i, parts in enumerate(payloads):
            for j, buf in enumerate(parts):
                lo, hi = self.chunks[j]
                out[lo:hi, i] = self.chunk_array(buf, j)
        return out

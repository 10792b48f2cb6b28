"""The L2 tier: full KV blocks in Redis (or Valkey), shared by the pools of many hosts.

One host's shared pool is the L1. With ``shmcache serve --l2 redis://...`` a
worker also writes every block it publishes to Redis (in a background
thread) and, when a prompt's prefix is not all in L1, asks Redis for the
chain's next blocks, loads them into fresh pool blocks, publishes them in L1
and computes only the rest.

Pieces, from the bottom up:

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
  the pool arena's bytes. The MAC is a keyed blake2b-128 (key derived from
  the secret) of the header and payload: it is the checksum, and a value
  can only be made by a holder of the secret, for that key.
* :class:`RedisL2`: the client side. :meth:`RedisL2.lookup` (the serving
  thread: pipelined ``MGET``, stops at the first missing or rejected block)
  and :meth:`RedisL2.put` (queues a copy; a background thread ``SET``\\ s it,
  pipelined). Faults never raise into the caller: short socket timeouts, an
  outage is warned about once and counted, and the server is tried again
  every ``retry_s``.
* :class:`L2Tier`: the glue to a pool manager (what the serving engine
  uses): :meth:`L2Tier.load` after an L1 lookup, :meth:`L2Tier.write_back`
  after a publish.

See docs/design.md, "The Redis tier (L2)", for the consistency argument.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

import numpy as np

log = logging.getLogger("shmcache.l2")

__all__ = ["KVLayout", "Codec", "RedisL2", "L2Tier", "Rejected", "fingerprint", "model_identity",
           "runtime_identity", "check_url", "redact", "FORMAT_VERSION", "DEFAULT_TIMEOUT", "DEFAULT_RETRY",
           "SECRET_ENV"]

FORMAT_VERSION = 1
KEY_PREFIX = b"shmcache:kv1:"
MAGIC = b"SHMCKV"
DEFAULT_TIMEOUT = 0.05                  # seconds, every socket operation of a lookup
DEFAULT_RETRY = 2.0                     # seconds between attempts during an outage
DEFAULT_MAX_VALUE = 4 << 20             # a block larger than this is cut into layer chunks
DEFAULT_QUEUE_BYTES = 256 << 20         # write-back queued and not yet sent, at most
DEFAULT_BATCH_BYTES = 32 << 20          # one MGET or one SET pipeline, at most
PROBE_BLOCKS = 8                        # a lookup's first MGET: most lookups miss at once
SECRET_ENV = "SHMCACHE_CLUSTER_SECRET"

# header: magic, version, flags, fingerprint, chain hash, chunk, chunks,
# first layer, end layer, payload bytes, MAC
_HDR = struct.Struct("<6sBB16s16sHHHHQ16s")
HEADER_BYTES = _HDR.size
_MAC_OFF = HEADER_BYTES - 16

_NP = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}

COUNTERS = ("lookups", "hits", "misses", "read_bytes", "writes", "written_bytes", "dropped",
            "rejected", "timeouts", "errors", "outages")


class Rejected(ValueError):
    """A value that failed a check (the reason is the message)."""


# ----------------------------------------------------------------- layout
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
        lay = mgr.layout
        return cls(model_id, lay.dtype, mgr.block_size, lay.num_layers, lay.num_kv_heads,
                   lay.head_dim)

    @property
    def np_dtype(self) -> np.dtype:
        return _NP[self.dtype]

    @property
    def layer_bytes(self) -> int:
        """K and V of one layer of one block."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.np_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


def fingerprint(layout: KVLayout, chunk_layers: int) -> bytes:
    """16 bytes naming the model and the payload layout (not secret)."""
    desc = dict(format=FORMAT_VERSION, model=layout.model_id, dtype=layout.dtype,
                block_size=layout.block_size, layers=layout.num_layers,
                kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                chunk_layers=chunk_layers, byteorder="little")
    return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16,
                           person=b"shmcache-l2-fp").digest()


def runtime_identity() -> str:
    """What else decides the K/V's bits: the MLX version and the CPU
    architecture (hosts must compute bit-identical K/V to share them)."""
    try:
        from importlib.metadata import version
        mlx = version("mlx")
    except Exception:
        mlx = "?"
    return f"mlx-{mlx}-{platform.machine()}"


def model_identity(path, runtime: Optional[str] = None) -> str:
    """The model's name plus a digest of what makes its K/V: config.json, the
    weight files (name, size, first and last MiB of each) and the runtime
    (:func:`runtime_identity`, unless given). Cheap (a few MiB read); two
    different checkpoints under one name differ in it."""
    path = Path(path)
    h = hashlib.blake2b(digest_size=12, person=b"shmcache-model")
    h.update((runtime if runtime is not None else runtime_identity()).encode() + b"\x00")
    cfg = path / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.npz")):
        size = f.stat().st_size
        h.update(f"\x00{f.name}\x00{size}\x00".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return f"{path.name}@{h.hexdigest()}"


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


# ------------------------------------------------------------------ codec
class Codec:
    """Chain keys and values of one layout under one secret.

    Args:
        layout: the payload's layout.
        secret: the cluster secret (any bytes; pools share L2 entries only
            when their secrets are equal).
        max_value_bytes: a block whose payload is larger is cut into chunks
            of whole layers, each its own value (``<key>:c<j>``).
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
        """Chain hashes of the first ``n_blocks`` full blocks of ``tokens``;
        ``prev``: those of the first blocks, already computed (extended, not
        recomputed)."""
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
        lo, hi = self.chunks[chunk]
        payload = memoryview(payload).cast("B")
        hdr = _HDR.pack(MAGIC, FORMAT_VERSION, 0, self.fp, chain_hash, chunk, len(self.chunks),
                        lo, hi, len(payload), bytes(16))
        mac = hashlib.blake2b(hdr[:_MAC_OFF], digest_size=16, key=self._mac_key)
        mac.update(payload)
        return b"".join((hdr[:_MAC_OFF], mac.digest(), payload))

    def decode(self, value, chain_hash: bytes, chunk: int) -> memoryview:
        """The payload of a value read for (chain_hash, chunk); raises
        :class:`Rejected` unless every header field and the MAC check out."""
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
        """A chunk's payload as (layers, 2, H, T, D) (a view)."""
        lo, hi = self.chunks[chunk]
        lay = self.layout
        return np.frombuffer(payload, lay.np_dtype).reshape(
            hi - lo, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)


# ------------------------------------------------------------ the client
def check_url(url: str) -> str:
    """The URL if redis-py can take it (redis://, rediss://, unix://); raises ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"{redact(url)}: not a redis://HOST:PORT[/DB] URL (rediss:// for TLS, "
                         f"unix:///path for a socket)")
    if parts.scheme != "unix":
        if not parts.hostname:
            raise ValueError(f"{redact(url)}: no host")
        try:
            parts.port
        except ValueError:
            raise ValueError(f"{redact(url)}: bad port") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"{redact(url)}: the database must be a number, not {db!r}")
    return url


def redact(url: str) -> str:
    """The URL without its password (for logs)."""
    try:
        p = urlsplit(url)
    except ValueError:
        return "<bad url>"
    if p.password is None:
        return url
    host = p.hostname or ""
    netloc = f"{p.username or ''}:***@{host}" + (f":{p.port}" if p.port else "")
    return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))


def _client(url: str, timeout: float):
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise RuntimeError("--l2 needs the redis package (pip install redis)") from None
    # NOTE: no retries inside redis-py (its default retries ten times with
    # backoff): a fault must cost one timeout, and we retry on our own clock.
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                                health_check_interval=0, socket_keepalive=True)


def _is_timeout(e: BaseException) -> bool:
    import redis
    return isinstance(e, (redis.TimeoutError, TimeoutError))


class _Health:
    """Up or down (an outage), shared by the lookups and the writer thread."""

    def __init__(self, name: str, retry_s: float, counters: "_Counters") -> None:
        self.name = name
        self.retry_s = retry_s
        self.c = counters
        self.down = False
        self.retry_at = 0.0
        self._lock = threading.Lock()
        self._warned: set = set()

    def usable(self) -> bool:
        return not self.down or time.monotonic() >= self.retry_at

    def failed(self, e: BaseException) -> None:
        self.c.add("timeouts" if _is_timeout(e) else "errors")
        with self._lock:
            self.retry_at = time.monotonic() + self.retry_s
            if self.down:
                return
            self.down = True
        self.c.add("outages")
        log.warning("L2 %s is unavailable (%s: %s): serving from L1 alone; retrying every %g s",
                    self.name, type(e).__name__, e, self.retry_s)

    def ok(self) -> None:
        if self.down:
            with self._lock:
                was, self.down = self.down, False
            if was:
                log.warning("L2 %s answers again: using it", self.name)

    def warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.v = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.v[name] += n

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.v)


class RedisL2:
    """A Redis (or Valkey) server as the L2 of one layout.

    Args:
        url: ``redis://HOST:PORT[/DB]`` (``rediss://`` for TLS).
        codec: keys and values (:class:`Codec`).
        timeout: seconds for each socket operation of a lookup (connect,
            send, each read); a lookup never waits longer than that for
            Redis to answer.
        write_timeout: the same for the writer thread (default: 1 s, at
            least ``timeout``).
        retry_s: during an outage, seconds between attempts.
        ttl: seconds a value lives (None: until Redis evicts it).
        queue_bytes: write-back payload queued at most; beyond, blocks are
            dropped (counted), never waited for.
    """

    def __init__(self, url: str, codec: Codec, *, timeout: float = DEFAULT_TIMEOUT,
                 write_timeout: Optional[float] = None, retry_s: float = DEFAULT_RETRY,
                 ttl: Optional[int] = None, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.url = check_url(url)
        self.codec = codec
        self.ttl = int(ttl) if ttl else None
        self.queue_bytes = queue_bytes
        self.c = _Counters()
        self.health = _Health(redact(url), retry_s, self.c)
        self._r = _client(url, timeout)
        self._w = _client(url, max(timeout, write_timeout if write_timeout is not None else 1.0))
        vb = codec.layout.block_bytes + HEADER_BYTES * len(codec.chunks)
        self._batch_blocks = max(1, batch_bytes // vb)
        self._batch_bytes = batch_bytes
        self._q: deque = deque()
        self._qbytes = 0
        self._cv = threading.Condition()
        self._closing = False
        self._busy = False
        self._thread = threading.Thread(target=self._writer, name="shmcache-l2-writer",
                                        daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- reads
    def lookup(self, chain: Sequence[bytes]) -> List[List[memoryview]]:
        """The payloads (one per chunk) of the longest run of ``chain``'s
        blocks found in Redis, from its first; stops at the first block
        missing or rejected. Never raises for a Redis fault (an empty or
        shorter run instead)."""
        if not chain or not self.health.usable():
            return []
        self.c.add("lookups")
        codec, nc = self.codec, len(self.codec.chunks)
        found: list = []
        nbytes = 0
        i, n, ended = 0, min(PROBE_BLOCKS, self._batch_blocks), False
        while i < len(chain) and not ended:
            part = chain[i:i + n]
            keys = [k for h in part for k in codec.keys(h)]
            try:
                values = self._r.mget(keys)
            except Exception as e:        # redis.RedisError, OSError: Redis is not answering
                self.health.failed(e)
                break
            self.health.ok()
            for j, h in enumerate(part):
                vals = values[j * nc:(j + 1) * nc]
                if any(v is None for v in vals):
                    ended = True
                    break
                try:
                    found.append([codec.decode(v, h, k) for k, v in enumerate(vals)])
                except Rejected as e:
                    self.c.add("rejected")
                    self.health.warn_once("rejected", "L2 %s: a value was rejected (%s); "
                                          "computing the block instead", self.health.name, e)
                    ended = True
                    break
                nbytes += sum(len(v) for v in vals)
            i += len(part)
            n = self._batch_blocks
        if ended or i >= len(chain):
            self.c.add("misses", len(chain) - len(found))
        self.c.add("hits", len(found))
        self.c.add("read_bytes", nbytes)
        return found

    # ------------------------------------------------------------- writes
    def accepting(self, nbytes: int = 0) -> bool:
        """Whether :meth:`put` would queue ``nbytes`` more now."""
        return self.health.usable() and self._qbytes + nbytes <= self.queue_bytes

    def put(self, chain: Sequence[bytes], blocks: np.ndarray) -> bool:
        """Queue blocks for writing: ``blocks`` is (L, n, 2, H, T, D), owned by
        this object from now on, ``chain`` their n chain hashes. Returns
        False (the blocks dropped, counted) when the queue is full or Redis
        is down."""
        n = len(chain)
        if not n:
            return True
        nbytes = int(blocks.nbytes)
        with self._cv:
            if self._closing or not self.accepting(nbytes):
                self.c.add("dropped", n)
                return False
            self._q.append((list(chain), blocks))
            self._qbytes += nbytes
            self._cv.notify()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
        return True

    def _take(self) -> Optional[list]:
        with self._cv:
            self._busy = False
            self._cv.notify_all()
            while not self._q and not self._closing:
                self._cv.wait()
            if not self._q:
                return None
            items, size = [], 0
            while self._q and (not items or size + self._q[0][1].nbytes <= self._batch_bytes):
                it = self._q.popleft()
                size += it[1].nbytes
                items.append(it)
            self._qbytes -= size
            self._busy = True
            return items

    def _writer(self) -> None:
        codec = self.codec
        while True:
            items = self._take()
            if items is None:
                return
            n = sum(len(ch) for ch, _ in items)
            if not self.health.usable():
                self.c.add("dropped", n)
                continue
            try:
                pipe = self._w.pipeline(transaction=False)
                sizes = []
                for chain, blocks in items:
                    for i, h in enumerate(chain):
                        blk = blocks[:, i]
                        size = 0
                        for j, (key, (lo, hi)) in enumerate(zip(codec.keys(h), codec.chunks)):
                            value = codec.encode(h, j, np.ascontiguousarray(blk[lo:hi]))
                            size += len(value)
                            pipe.set(key, value, ex=self.ttl)
                        sizes.append(size)
                results = pipe.execute(raise_on_error=False)
            except Exception as e:
                self.c.add("dropped", n)
                if isinstance(e, (OSError,)) or type(e).__module__.startswith("redis"):
                    self.health.failed(e)
                else:                          # a bug: say so, keep serving
                    log.exception("L2 write-back failed")
                    self.c.add("errors")
                continue
            self.health.ok()
            nc = len(codec.chunks)
            for b, size in enumerate(sizes):
                res = results[b * nc:(b + 1) * nc]
                bad = [r for r in res if isinstance(r, Exception)]
                if bad:
                    self.c.add("errors")
                    self.c.add("dropped")
                    self.health.warn_once("write", "L2 %s refused a write (%s); blocks are "
                                          "dropped while it does", self.health.name, bad[0])
                else:
                    self.c.add("writes")
                    self.c.add("written_bytes", size)

    # -------------------------------------------------------------- misc
    def stats(self) -> dict:
        s = self.c.snapshot()
        s["up"] = 0 if self.health.down else 1
        s["queued_bytes"] = self._qbytes
        return s

    def ping(self) -> bool:
        try:
            self._r.ping()
        except Exception as e:
            self.health.failed(e)
            return False
        self.health.ok()
        return True

    def close(self, flush_s: float = 1.0) -> None:
        """Write what is queued (for up to ``flush_s``), then stop the thread."""
        if flush_s > 0 and self.health.usable():
            self.flush(flush_s)
        with self._cv:
            self._closing = True
            self._q.clear()
            self._qbytes = 0
            self._cv.notify_all()
        self._thread.join(max(1.0, flush_s))
        for c in (self._r, self._w):
            try:
                c.close()
            except Exception:
                pass


# ------------------------------------------------------- the pool's side
def _arena(mgr):
    """The pool's K/V arena, (L, max_blocks, 2, H, T, D) in the storage
    dtype, where reachable and as expected; else None (then the public,
    per-layer ``read_kv``/``write_kv`` are used).

    NOTE: a private attribute of the pool: one copy of n blocks instead of
    a call per block and layer. A public bulk read/write of raw blocks in
    the manager would replace it."""
    a = getattr(getattr(mgr, "_p", None), "arena", None)
    if not isinstance(a, np.ndarray):
        return None
    lay = mgr.layout
    want = (lay.num_layers, mgr.max_blocks, 2, lay.num_kv_heads, mgr.block_size, lay.head_dim)
    return a if a.shape == want and a.dtype == _NP[lay.dtype] else None


def read_blocks(mgr, ids: Sequence[int]) -> np.ndarray:
    """A copy of blocks' K/V, (L, n, 2, H, T, D), in the storage dtype. The
    blocks must be held (published blocks are never written again)."""
    ids = [int(b) for b in ids]
    arena = _arena(mgr)
    if arena is not None:
        return arena[:, ids]
    import mlx.core as mx
    lay = mgr.layout
    H, T, D, n = lay.num_kv_heads, mgr.block_size, lay.head_dim, len(ids)
    out = np.empty((lay.num_layers, n, 2, H, T, D), _NP[lay.dtype])
    for layer in range(lay.num_layers):
        for kv, a in enumerate(mgr.read_kv(ids, layer)):
            if lay.dtype == "bfloat16":
                a = a.view(mx.uint16)
            out[layer, :, kv] = np.array(a).reshape(H, n, T, D).transpose(1, 0, 2, 3)
    return out


def write_blocks(mgr, codec: Codec, ids: Sequence[int], payloads: List[List[memoryview]]) -> None:
    """Write loaded payloads into blocks this manager holds (and nobody else
    does: fresh from ``get_new_blocks``)."""
    arena = _arena(mgr)
    if arena is not None:
        getattr(mgr._p, "check_usable", lambda: None)()
        for b, parts in zip(ids, payloads):
            for j, buf in enumerate(parts):
                lo, hi = codec.chunks[j]
                arena[lo:hi, int(b)] = codec.chunk_array(buf, j)
        return
    w = mgr.write_kv
    for b, parts in zip(ids, payloads):
        for j, buf in enumerate(parts):
            a = codec.chunk_array(buf, j)
            lo = codec.chunks[j][0]
            for i in range(a.shape[0]):
                w(int(b), lo + i, a[i, 0], a[i, 1])


class L2Tier:
    """The L2 of one pool manager: what the serving engine calls.

    Args:
        mgr: the manager (a worker's).
        url: the Redis URL.
        model_id: the model's identity (:func:`model_identity`).
        secret: the cluster secret (bytes); pools share only under one secret.
        timeout, retry_s, ttl, queue_bytes: as :class:`RedisL2`.
        max_value_bytes: as :class:`Codec`.
    """

    def __init__(self, mgr, url: str, *, model_id: str, secret: bytes,
                 timeout: float = DEFAULT_TIMEOUT, retry_s: float = DEFAULT_RETRY,
                 ttl: Optional[int] = None, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 max_value_bytes: int = DEFAULT_MAX_VALUE, write_timeout: Optional[float] = None
                 ) -> None:
        self.mgr = mgr
        self.bs = mgr.block_size
        self.codec = Codec(KVLayout.of(mgr, model_id), secret, max_value_bytes)
        self.store = RedisL2(url, self.codec, timeout=timeout, retry_s=retry_s, ttl=ttl,
                             queue_bytes=queue_bytes, write_timeout=write_timeout)
        self._failed_once = False

    def chain(self, tokens, n_blocks: int, extra_keys=None, prev=None) -> List[bytes]:
        return self.codec.chain(tokens, n_blocks, extra_keys, prev)

    def load(self, table, tokens, extra_keys, first: int, chain: Sequence[bytes]) -> int:
        """After an L1 hit of ``first`` blocks (already in ``table``), load
        the next blocks of ``chain`` found in L2 into new pool blocks, append
        them to ``table`` and publish them in L1. Returns how many blocks.
        Never raises for an L2 fault or a full pool (0 then)."""
        want = list(chain[first:])
        if not want:
            return 0
        t0 = time.perf_counter()
        found = self.store.lookup(want)
        if not found:
            return 0
        t1 = time.perf_counter()
        from .errors import OutOfBlocksError
        mgr = self.mgr
        try:
            blocks = mgr.get_new_blocks(len(found))
        except OutOfBlocksError:
            return 0                   # the prefill will wait for room as usual
        ids = [b.block_id for b in blocks]
        try:
            write_blocks(mgr, self.codec, ids, found)
        except Exception:
            mgr.free_block_batch(ids)
            self.store.c.add("errors")
            if not self._failed_once:
                self._failed_once = True
                log.exception("loading blocks from L2 failed; computing them")
            return 0
        t2 = time.perf_counter()
        for b in blocks:
            mgr.add_block_to_table(table, b, self.bs)
        n = first + len(found)
        mgr.cache_full_blocks(table.block_ids[:n], list(tokens[:n * self.bs]), first, n,
                              extra_keys)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("L2: %d blocks after %d from L1: lookup %.1f ms, K/V into the pool %.1f "
                      "ms, into the table and published %.1f ms", len(found), first,
                      (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3)
        return len(found)

    def write_back(self, ids: Sequence[int], chain: Sequence[bytes]) -> None:
        """Queue published blocks (held by the caller) for Redis."""
        if not ids:
            return
        per = self.codec.layout.block_bytes
        if not self.store.accepting(per * len(ids)):
            self.store.c.add("dropped", len(ids))
            return
        self.store.put(chain, read_blocks(self.mgr, ids))

    def stats(self) -> dict:
        return self.store.stats()

    def close(self, flush_s: float = 1.0) -> None:
        self.store.close(flush_s)

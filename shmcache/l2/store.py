"""A Redis (or Valkey) server as the L2 of one layout: lookups and write-back.

:meth:`RedisL2.start` queues a lookup for the fetch thread: pipelined ``MGET``
of the chain's blocks, stopping at the first missing or rejected one; the
caller polls :meth:`Lookup.ready` and takes what arrived by the lookup's
deadline (``timeout``, for the lookup as a whole) with :meth:`Lookup.take`.
:meth:`RedisL2.put` only queues a copy: a background thread ``SET``\\ s it,
pipelined, and every ``flush_s`` hands this process's counter deltas to a
sink (the pool-wide counters), so the serving path waits on neither. Faults
never raise into the caller (see ``client.Health``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, List, Optional, Sequence

import numpy as np

from .client import Counters, Health, check_url, connect, is_redis_fault, redact
from .codec import HEADER_BYTES, Codec, Rejected

log = logging.getLogger("shmcache.l2")

DEFAULT_TIMEOUT = 0.5                   # seconds, a lookup as a whole
DEFAULT_RETRY = 2.0                     # seconds between attempts during an outage
DEFAULT_QUEUE_BYTES = 256 << 20         # write-back queued and not yet sent, at most
DEFAULT_BATCH_BYTES = 32 << 20          # one MGET or one SET pipeline, at most
PROBE_BLOCKS = 8                        # a lookup's first MGET: most lookups miss at once
FLUSH_S = 0.5                           # counter deltas go to the sink at most this often


class RedisL2:
    """A Redis (or Valkey) server as the L2 of one layout.

    Args:
        url: ``redis://HOST:PORT[/DB]`` (``rediss://`` for TLS).
        codec: keys and values (:class:`~shmcache.l2.codec.Codec`).
        timeout: seconds a lookup has, as a whole (connect, sends and
            reads: :meth:`start`); each socket operation has as long.
        write_timeout: the same for the writer thread (default: 1 s, at
            least ``timeout``).
        retry_s: during an outage, seconds between attempts.
        ttl: seconds a value lives (None: until Redis evicts it).
        queue_bytes: write-back payload queued at most; beyond, blocks are
            dropped (counted), never waited for.
        batch_bytes: one ``MGET`` or one ``SET`` pipeline, at most.
        sink: ``sink({counter name: delta})``, called from the writer thread
            at most every ``flush_s`` seconds and at :meth:`close` with what
            changed (the thread holds it while it runs: it should hold a
            pool manager weakly, as ``tier.pool_counter_sink`` does).
    Raises:
        ValueError: a bad URL. RuntimeError: redis-py is not installed.
    """

    def __init__(self, url: str, codec: Codec, *, timeout: float = DEFAULT_TIMEOUT,
                 write_timeout: Optional[float] = None, retry_s: float = DEFAULT_RETRY,
                 ttl: Optional[int] = None, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 batch_bytes: int = DEFAULT_BATCH_BYTES,
                 sink: Optional[Callable[[dict], None]] = None, flush_s: float = FLUSH_S) -> None:
        self.url = check_url(url)
        self.codec = codec
        self.ttl = int(ttl) if ttl else None
        self.queue_bytes = queue_bytes
        self.c = Counters()
        self.health = Health(redact(url), retry_s, self.c)
        self.timeout = timeout
        self._r = connect(url, timeout)           # the fetch thread's
        self._fq: deque = deque()                 # lookups not started
        self._fcv = threading.Condition()
        self._fetcher: Optional[threading.Thread] = None
        self._inflight: Optional[Lookup] = None
        self._w = connect(url, max(timeout, write_timeout if write_timeout is not None else 1.0))
        vb = codec.layout.block_bytes + HEADER_BYTES * len(codec.chunks)
        self._batch_blocks = max(1, batch_bytes // vb)
        self._batch_bytes = batch_bytes
        self._sink = sink
        self._flush_s = flush_s
        self._flush_lock = threading.Lock()
        self._next_flush = time.monotonic() + flush_s
        self._q: deque = deque()
        self._qbytes = 0
        self._cv = threading.Condition()
        self._closing = False
        self._closed = False
        self._busy = False
        self._thread = threading.Thread(target=self._writer, name="shmcache-l2-writer",
                                        daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- reads
    def lookup(self, chain: Sequence[bytes],
               timeout: Optional[float] = None) -> List[List[memoryview]]:
        """The payloads of the longest run of ``chain``'s blocks in Redis
        that arrives within ``timeout`` (default: this store's): :meth:`start`
        then :meth:`Lookup.wait`.

        Args:
            chain: chain hashes, from the first block wanted.
        Returns:
            One list of chunk payloads per block found, from the first;
            stops at the first block missing or rejected. Empty or shorter
            for a Redis fault or a deadline passed: never raises for either.
        """
        return self.start(chain, timeout).wait()

    def start(self, chain: Sequence[bytes], timeout: Optional[float] = None) -> "Lookup":
        """Start a lookup of ``chain`` on the fetch thread; it ends, as a
        whole, ``timeout`` seconds from now (default: this store's).

        INVARIANT: the caller's thread never waits on Redis: the lookup runs
        on this store's fetch thread (one at a time, in order), and
        :meth:`Lookup.take` returns at once with the blocks that arrived.
        Past the deadline, a lookup still in flight is aborted (its
        connection closed) so that a dripping Redis holds nothing.
        """
        timeout = self.timeout if timeout is None else timeout
        lk = Lookup(self, list(chain), time.monotonic() + timeout)
        if not lk.chain or not self.health.usable():
            lk.done.set()
            return lk
        self.c.add("lookups")
        with self._fcv:
            if self._fetcher is None:
                self._fetcher = threading.Thread(target=self._fetch_loop,
                                                 name="shmcache-l2-fetch", daemon=True)
                self._fetcher.start()
            self._fq.append(lk)
            self._fcv.notify()
        return lk

    def _fetch_loop(self) -> None:
        while True:
            with self._fcv:
                while not self._fq and not self._closing:
                    self._fcv.wait()
                if not self._fq:
                    return
                lk = self._fq.popleft()
                self._inflight = lk
            try:
                if not lk.taken and time.monotonic() < lk.deadline and self.health.usable():
                    self._fetch(lk)
            finally:
                with self._fcv:
                    self._inflight = None
                lk.done.set()

    def _fetch(self, lk: "Lookup") -> None:
        """Pipelined ``MGET``\\ s of ``lk.chain`` on the fetch thread; each
        batch's blocks are appended to ``lk.found`` as it arrives."""
        codec, nc, chain = self.codec, len(self.codec.chunks), lk.chain
        i, n = 0, min(PROBE_BLOCKS, self._batch_blocks)
        while i < len(chain):
            if lk.taken or time.monotonic() >= lk.deadline:
                return
            part = chain[i:i + n]
            keys = [k for h in part for k in codec.keys(h)]
            try:
                values = self._r.mget(keys)
            except Exception as e:        # redis.RedisError, OSError: Redis is not answering
                if not lk.taken:          # (else: aborted at the deadline, counted there)
                    self.health.failed(e)
                return
            self.health.ok()
            got, nbytes, ended = [], 0, False
            for j, h in enumerate(part):
                vals = values[j * nc:(j + 1) * nc]
                if any(v is None for v in vals):
                    ended = True
                    break
                try:
                    got.append([codec.decode(v, h, k) for k, v in enumerate(vals)])
                except Rejected as e:
                    self.c.add("rejected")
                    self.health.warn_once("rejected", "L2 %s: a value was rejected (%s); "
                                          "computing the block instead", self.health.name, e)
                    ended = True
                    break
                nbytes += sum(len(v) for v in vals)
            with lk.lock:
                if lk.taken:
                    return
                lk.found.extend(got)
                self.c.add("read_bytes", nbytes)
            if ended:
                lk.ended = True
                return
            i += len(part)
            n = self._batch_blocks
        lk.ended = True

    def abort_lookup(self, lk: "Lookup") -> None:
        """``lk`` was taken before it ended: close the connection it is
        reading from (if it is in flight), so the fetch thread is free."""
        with self._fcv:
            if self._inflight is not lk:
                return
        try:
            self._r.connection_pool.disconnect(inuse_connections=True)
        except Exception:                 # already closed
            pass

    # ------------------------------------------------------------- writes
    def accepting(self, nbytes: int = 0) -> bool:
        """Whether :meth:`put` would queue ``nbytes`` more now."""
        return self.health.usable() and self._qbytes + nbytes <= self.queue_bytes

    def put(self, chain: Sequence[bytes], blocks: np.ndarray) -> bool:
        """Queue blocks for writing.

        Args:
            chain: the n blocks' chain hashes.
            blocks: ``# (L, n, 2, H, T, D)``, owned by this object from now on.
        Returns:
            False (the blocks dropped, counted) when the queue is full or
            Redis is down.
        """
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
        """The next batch to write; [] when the counters are due; None at close."""
        with self._cv:
            self._busy = False
            self._cv.notify_all()
            while not self._q and not self._closing:
                if self._sink is None:
                    self._cv.wait()
                    continue
                left = self._next_flush - time.monotonic()
                if left <= 0:
                    return []
                self._cv.wait(left)
            if not self._q:
                return None
            items: list = []
            size = 0
            while self._q and (not items or size + self._q[0][1].nbytes <= self._batch_bytes):
                it = self._q.popleft()
                size += it[1].nbytes
                items.append(it)
            self._qbytes -= size
            self._busy = True
            return items

    def _writer(self) -> None:
        while True:
            items = self._take()
            if items is None:
                return
            if self._sink is not None and time.monotonic() >= self._next_flush:
                self.flush_counters()
            if items:
                self._write(items)

    def _write(self, items: list) -> None:
        codec = self.codec
        n = sum(len(ch) for ch, _ in items)
        if not self.health.usable():
            self.c.add("dropped", n)
            return
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
            if is_redis_fault(e):
                self.health.failed(e)
            else:                          # a bug: say so, keep serving
                log.exception("L2 write-back failed")
                self.c.add("errors")
            return
        self.health.ok()
        nc = len(codec.chunks)
        for b, size in enumerate(sizes):
            bad = [r for r in results[b * nc:(b + 1) * nc] if isinstance(r, Exception)]
            if bad:
                self.c.add("errors")
                self.c.add("dropped")
                self.health.warn_once("write", "L2 %s refused a write (%s); blocks are "
                                      "dropped while it does", self.health.name, bad[0])
            else:
                self.c.add("writes")
                self.c.add("written_bytes", size)

    # -------------------------------------------------------------- misc
    def flush_counters(self) -> None:
        """Hand the counter deltas since the last call to the sink (if any)."""
        with self._flush_lock:
            self._next_flush = time.monotonic() + self._flush_s
            if self._sink is None:
                return
            deltas = self.c.take()
            if not deltas:
                return
            try:
                self._sink(deltas)
            except Exception as e:          # the pool is closed or gone: counts are lost
                log.debug("L2 counters not added to the pool: %r", e)

    def stats(self) -> dict:
        """This process's counters, ``up`` (0 in an outage) and ``queued_bytes``."""
        s = self.c.snapshot()
        s["up"] = 0 if self.health.down else 1
        s["queued_bytes"] = self._qbytes
        return s

    def ping(self) -> bool:
        """Whether Redis answers now (counted and logged as any operation)."""
        try:
            self._r.ping()
        except Exception as e:
            self.health.failed(e)
            return False
        self.health.ok()
        return True

    def close(self, flush_s: float = 1.0) -> None:
        """Write what is queued (for up to ``flush_s``), stop the thread,
        hand the last counter deltas to the sink. Idempotent."""
        if self._closed:
            return
        if flush_s > 0 and self.health.usable():
            self.flush(flush_s)
        with self._fcv:
            self._closing = True
            for lk in self._fq:
                lk.done.set()
            self._fq.clear()
            self._fcv.notify_all()
        with self._cv:
            self._closing = True
            self._q.clear()
            self._qbytes = 0
            self._cv.notify_all()
        self._thread.join(max(1.0, flush_s))
        if self._fetcher is not None:
            if self._inflight is not None:
                self.abort_lookup(self._inflight)
            self._fetcher.join(1.0)
        self._closed = True
        for c in (self._r, self._w):
            try:
                c.close()
            except Exception:
                pass
        self.flush_counters()


class Lookup:
    """One lookup of :meth:`RedisL2.start`: ``found`` grows batch by batch
    on the fetch thread until the run ends, a fault, or ``deadline``
    (``time.monotonic()``); :meth:`take` hands the caller what arrived and
    stops the lookup.

    INVARIANT: ``found`` is always a prefix of the run in Redis (whole
    blocks, checked, from the first wanted): taking it early only makes the
    prefix shorter.
    """

    def __init__(self, store: RedisL2, chain: list, deadline: float) -> None:
        self.store = store
        self.chain = chain
        self.deadline = deadline
        self.found: list = []
        self.ended = False              # the run is complete (a miss or the chain's end)
        self.taken = False
        self.lock = threading.Lock()
        self.done = threading.Event()   # the fetch thread is finished with it

    def ready(self) -> bool:
        """Finished, or its deadline has passed: :meth:`take` waits no more."""
        return self.done.is_set() or time.monotonic() >= self.deadline

    def wait(self) -> list:
        """:meth:`take` once ready (blocks the calling thread up to the deadline)."""
        self.done.wait(max(0.0, self.deadline - time.monotonic()))
        return self.take()

    def take(self) -> list:
        """The blocks that arrived (a prefix of the run; [] after a fault).
        The first call ends the lookup (a lookup still reading is aborted
        and counted as a timeout) and counts its hits and misses."""
        with self.lock:
            if self.taken:
                return list(self.found)
            self.taken = True
            found = list(self.found)
        s, c = self.store, self.store.c
        if not self.done.is_set() and self.chain and not self.ended:
            s.abort_lookup(self)
            if time.monotonic() >= self.deadline:
                # slow: down (as a timeout) unless part of it arrived, when
                # the lookup was merely too large for its deadline
                if found:
                    c.add("timeouts")
                else:
                    s.health.failed(TimeoutError(f"no answer within the lookup's "
                                                 f"{s.timeout:g} s"))
        if self.ended:
            c.add("misses", len(self.chain) - len(found))
        c.add("hits", len(found))
        return found

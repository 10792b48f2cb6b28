"""A mapped pool segment: creation, attaching, the views every module uses.

``Pool`` owns the file descriptor and the mapping, and is composed of its
parts, each one object owning its state: ``views`` (``MappedViews``, below:
the named views of the segment's regions), ``slot_ops`` (``slots.SlotOps``:
this manager's slot in the slot table, the identity under which it holds
references, and telling live slots from dead ones), ``lock`` and ``ops``.
Here: creating and initialising a segment, attaching, mapping the views,
taking a slot (reclaiming dead ones when none is free), the repair when the
lock finds the pool dirty, and unmapping. It knows nothing of the
paged-cache API; ``PagedCacheManager`` builds that on top.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Tuple

import numpy as np

from ..shm import layout as L
from ..shm import claims, segment
from . import recovery
from .reclaim import reclaim_dead_slots
from .reserve import reserved_total
from ..shm.hot_ops import NativeOps, ReferenceOps
from ..shm.counters import Counters
from ..shm.index import OpenIndex
from ..errors import CorruptPoolError, PoolClosedError
from ..shm.lock import PoolLock, open_hot
from ..shm.slots import SlotOps, live_pools, process_start_time

logger = logging.getLogger("shmcache.manager.paged_cache")

# the word of the seed's token counter, for the C accelerator's add_counter(i, n)
_TOKENS_WORD = Counters.word("tokens")


def _positive_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def block_usage(ref_count, flags) -> dict:
    """The one definition of a pool's block figures, for ``shmcache inspect``
    and ``/metrics`` (``shmcache_pool_blocks_*``), from the blocks' reference
    counts and flags (arrays over the blocks):

    * block 0, the null block (always referenced, never cached), is left out;
    * ``blocks_used``: referenced by some table or process;
    * ``blocks_cached``: holding published prefix data (referenced or not: an
      unreferenced cached block sits on the free list, evicted when taken);
    * ``blocks_free``: neither: holding nothing at all;
    * ``blocks_total``: the pool's blocks but the null block.

    Unused + cached = total when nothing is in use."""
    ref = ref_count[1:] > 0
    cached = (flags[1:] & L.FLAG_CACHED) != 0
    return {"blocks_total": int(ref.size), "blocks_used": int(ref.sum()),
            "blocks_cached": int(cached.sum()), "blocks_free": int((~ref & ~cached).sum())}


def prefix_hit_rate(hits: int, misses: int) -> float:
    """The one definition of the pool's prefix hit rate, for ``shmcache
    inspect`` and ``/metrics`` (``shmcache_pool_prefix_hit_rate``): the
    prompt blocks found in the cache over the prompt blocks looked up, since
    the pool was made (the pool's own counters; 0 before any lookup)."""
    return hits / (hits + misses) if hits + misses else 0.0


def _words(a: Any) -> Any:
    """A memoryview over a numpy array (typed Any: numpy's stubs do not say
    an ndarray is a buffer, and typeshed's memoryview stores ints only,
    where ``last_access`` holds floats)."""
    return memoryview(a)


class MappedViews:
    """The segment's structures as numpy arrays and memoryviews over one
    buffer: what ``Pool`` works on (``Pool.views``), and what a snapshot
    (``inspect_pool.PoolView.check``: a private copy of the metadata, read
    only by ``recovery.check``) builds over its copy.

    It owns the views (``NAMES``) and drops them all at once (``release``);
    its collaborators, given to the constructor: the buffer (``mm``: the
    segment, or a private copy of its metadata), the ``layout`` describing
    it, and ``corrupt`` (the error factory the index views report
    corruption through: ``Pool.corrupt``, or a snapshot's). Without
    ``arena`` the K/V arena is left unmapped (``arena`` is None).

    Only the counters have named accessors (``gauges``, the properties
    below); the arrays are the owner modules' (layout.py's byte map).
    """

    # every view this object owns, in the order they are built (``Pool``
    # binds the same names to the same objects: see ``Pool.bind_views``)
    NAMES = ("raw", "header", "counter_array", "c", "counters", "slots", "blocks", "hidx", "chunks",
             "kmat", "kw", "tables", "tidx", "b_ref", "b_prev", "b_next", "b_flags",
             "b_tok", "b_last", "b_gen", "t_state", "t_owner", "t_head", "t_tail",
             "t_len", "t_tok", "t_rhash", "t_claim", "s_head", "s_count", "hhome",
             "hindex", "tindex", "HEAD", "TAIL", "arena")

    def __init__(self, mm: Any, layout: L.Layout, corrupt: Any, arena: bool = True) -> None:
        self.mm = mm
        self.layout = layout
        self.corrupt = corrupt
        lay = layout
        self.raw = memoryview(mm)
        self.header = np.frombuffer(mm, L.HEADER_DTYPE, 1, 0)
        self.counter_array = np.frombuffer(mm, np.int64, L.NUM_COUNTERS, lay.counters_off)
        self.c = _words(self.counter_array)     # the counter words (``C_*``)
        self.counters = Counters.from_buffer(mm, lay.counters_off)   # the same, by name
        self.slots = np.frombuffer(mm, L.SLOT_DTYPE, lay.max_slots, lay.slots_off)
        self.blocks = np.frombuffer(mm, L.BLOCK_DTYPE, lay.max_blocks + 2, lay.blocks_off)
        self.hidx = np.frombuffer(mm, np.int32, lay.hash_capacity, lay.hash_off)
        self.chunks = np.frombuffer(mm, L.CHUNK_DTYPE, lay.num_chunks, lay.refs_off)
        kw = np.frombuffer(mm, np.int32, lay.num_chunks * L.CHUNK_WORDS, lay.refs_off)
        self.kmat = kw.reshape(lay.num_chunks, L.CHUNK_WORDS)   # [chunk, 0]: link
        self.kw = _words(kw)                               # the chunk area as words
        self.tables = np.frombuffer(mm, L.TABLE_DTYPE, lay.max_tables, lay.tables_off)
        self.tidx = np.frombuffer(mm, np.int32, lay.table_capacity, lay.tindex_off)
        b = self.blocks
        self.b_ref = _words(b["ref_count"])
        self.b_prev = _words(b["prev"])
        self.b_next = _words(b["next"])
        self.b_flags = _words(b["flags"])
        self.b_tok = _words(b["token_count"])
        self.b_last = _words(b["last_access"])
        self.b_gen = _words(b["gen"])
        t = self.tables
        self.t_state = _words(t["state"])
        self.t_owner = _words(t["owner"])
        self.t_head = _words(t["head"])
        self.t_tail = _words(t["tail"])
        self.t_len = _words(t["length"])
        self.t_tok = _words(t["num_tokens"])
        self.t_rhash = _words(t["rid_hash"])
        self.t_claim = _words(t["claim"])
        self.s_head = _words(self.slots["loose_head"])
        self.s_count = _words(self.slots["loose_count"])
        raw = self.raw
        boff = lay.blocks_off + L.BLOCK_HASH_OFF
        isz = L.BLOCK_DTYPE.itemsize
        self.hhome = lambda e: int.from_bytes(raw[boff + e * isz: boff + e * isz + 8], "little")
        self.hindex = OpenIndex(_words(self.hidx), self.hhome,
                                lambda e, key: raw[boff + e * isz: boff + e * isz + 16] == key,
                                lay.max_blocks, corrupt, "prefix index")
        rids, rhash = self.tables["request_id"], self.tables["rid_hash"]
        self.tindex = OpenIndex(_words(self.tidx), lambda e: int(rhash[e]),
                                lambda e, key: rids[e] == key,
                                lay.max_tables, corrupt, "table index")
        self.HEAD = lay.max_blocks
        self.TAIL = lay.max_blocks + 1
        self.arena: Any = None      # the K/V arena array, or None when not mapped
        if lay.num_layers and arena:
            np_dtype = L.KV_DTYPES[lay.dtype].np_dtype
            self.arena = np.frombuffer(mm, np_dtype, int(np.prod(lay.arena_shape)),
                                       lay.arena_off).reshape(lay.arena_shape)

    def release(self) -> None:
        """Drop every view (``NAMES``), so that the buffer can be closed once
        no caller holds one of its own."""
        for k in self.NAMES:
            setattr(self, k, None)

    # ================================================================ gauges
    def gauges(self) -> dict:
        """The pool's figures by name for ``/metrics`` and the CLI, read
        without the lock (statistics: each counter is one aligned word,
        never torn; the set is not one instant): ``block_usage``'s
        blocks_total/used/cached/free; free_list_blocks and
        reserved_blocks; tables, hits, misses, prefix_hit_rate, cow,
        evictions, ops (lock holds), recoveries, reclaimed_refs,
        lock_wait_max_s, lock_turns, lock_queue, dirty, free_ref_chunks."""
        k, n = self.counters, self.layout.max_blocks
        b = self.blocks
        g = block_usage(b["ref_count"][:n], b["flags"][:n])
        hits, misses = int(k.hits), int(k.misses)
        g.update(free_list_blocks=int(k.num_free), reserved_blocks=reserved_total(self),
                 tables=int(k.num_tables), hits=hits, misses=misses,
                 prefix_hit_rate=prefix_hit_rate(hits, misses), cow=int(k.cow),
                 evictions=int(k.evictions), ops=int(k.ops),
                 recoveries=int(k.recoveries), reclaimed_refs=int(k.reclaimed),
                 lock_wait_max_s=int(k.lock_wait_ns) / 1e9,
                 lock_turns=int(k.turn_next), lock_queue=k.lock_queue,
                 dirty=bool(k.dirty), free_ref_chunks=int(k.free_refs))
        return g


class Pool:
    """One manager's view of a pool segment (not thread-safe by itself;
    callers hold ``lock``).

    It owns the file descriptor, the mapping and the header's facts
    (``created_at``, ``seed``), and is composed of:

    * ``views`` (``MappedViews``): the named views of the segment's regions.
      The hot paths read them through the same names on the pool
      (``pool.blocks``, ``pool.c``, ...): references to ``views``' objects
      bound once (``bind_views``), not copies, dropped with them at ``unmap``;
    * ``counters`` (``counters.Counters``, built by ``views``): the counter
      words by name (``pool.counters.num_free``, ``.count_eviction()``);
    * ``slot_ops`` (``slots.SlotOps``): this manager's slot (``slot``), its
      liveness byte, and whether other slots' holders are alive;
    * ``lock`` (``lock.PoolLock``) and ``ops`` (``hot_ops``: the C
      accelerator's operations or the Python reference), chosen once here.
    """

    views: MappedViews
    # (the aliases of ``views``' objects: ``MappedViews.NAMES``, bound by
    # ``bind_views``; test_gauges checks the two lists agree)
    raw: Any
    header: Any
    counter_array: Any
    c: Any
    counters: Counters
    slots: Any
    blocks: Any
    hidx: Any
    chunks: Any
    kmat: Any
    kw: Any
    tables: Any
    tidx: Any
    b_ref: Any
    b_prev: Any
    b_next: Any
    b_flags: Any
    b_tok: Any
    b_last: Any
    b_gen: Any
    t_state: Any
    t_owner: Any
    t_head: Any
    t_tail: Any
    t_len: Any
    t_tok: Any
    t_rhash: Any
    t_claim: Any
    s_head: Any
    s_count: Any
    hhome: Any
    hindex: Any
    tindex: Any
    HEAD: int
    TAIL: int
    arena: Any

    def __init__(self, name: str, fd: int, mm, lay: L.Layout, creator: bool, private: bool):
        self.name = name
        self.fd = fd
        self.mm = mm
        self.layout = lay
        self.creator = creator
        self.private = private
        self.closed = False
        self._repairing = False
        self.views = MappedViews(mm, lay, self.corrupt)
        self.bind_views()
        self._read_header()
        # the pool mutex and the fused operations (C, or ctypes + fastpath)
        self.native, self.ops = self._open_native()
        self.lock = PoolLock(self.native, self.counters, self._on_dirty)
        self.slot_ops = SlotOps(name, fd, lay, self.views, self.lock)
        # This manager's slot (-1 before it has one and after it let it go):
        # ``slot_ops.slot``, copied here by the two methods that change it
        # (``_take_slot``, ``release_slot``), a plain attribute read by every
        # hot path (a property would cost each call about 40 ns).
        self.slot = -1
        self.lock.check_usable = self.check_usable
        self.lock.unusable = False
        self.lock.release_claims = lambda: claims.release(self)
        self.lock.on_stuck = self.slot_ops.on_stuck_lock_word
        self.reclaimed_in_repair = 0     # references released by repairs, not yet reported
        live_pools.add(self)       # (last: the fork handler needs a whole Pool)

    def bind_views(self) -> None:
        """Bind ``views``' objects under the same names here (``MappedViews.
        NAMES``), for the hot paths: one attribute read, not two."""
        v = self.views
        for k in MappedViews.NAMES:
            setattr(self, k, getattr(v, k))

    def _read_header(self) -> None:
        h = self.header[0]
        self.created_at = float(h["created_at"])
        self.seed = bytes(h["seed"])

    # ------------------------------------------------------ the slot (slot_ops)
    @property
    def forked(self) -> bool:
        """Whether this mapping was inherited by a forked child (which has no
        slot of its own: it must attach on its own)."""
        return self.slot_ops.forked

    def after_fork_in_child(self) -> None:
        """This process is a forked child (``slots.live_pools``' handler)."""
        self.slot_ops.after_fork_in_child()

    # ---------------------------------------------------------------- gauges
    def gauges(self) -> dict:
        """``MappedViews.gauges``: the pool's figures by name for
        ``/metrics`` and the CLI."""
        return self.views.gauges()

    def _open_native(self) -> Tuple[Any, ReferenceOps]:
        """The pool mutex and the hot operations, chosen here once: the C
        accelerator's (``NativeOps``) where ``_hot`` is loaded and fits this
        layout, else the Python reference (``ReferenceOps``)."""
        native = open_hot(self.mm, self.layout, self.created_at)
        if hasattr(native, "set_chunks"):
            # what the fused ops need beyond layout.hot_params: the chunk
            # count (they check every chunk id they read against it)
            native.set_chunks(self.layout.num_chunks)
            return native, NativeOps(native, self.c, self.t_claim)
        return native, ReferenceOps(self.c, self.t_claim)

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, name: str, *, block_size=64, max_blocks=1000, enable_caching=True,
               num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
               max_slots=64, max_tables=None, max_refs=None, private=False) -> "Pool":
        # (the ranges are layout.PARAM_RANGES: what attach accepts in a header)
        block_size = _positive_int("block_size", block_size)
        max_blocks = _positive_int("max_blocks", max_blocks)
        num_layers = _positive_int("num_layers", num_layers, 0)
        num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        head_dim = _positive_int("head_dim", head_dim)
        if dtype not in L.DTYPES:
            raise ValueError(f"dtype must be one of {sorted(L.DTYPES)}, got {dtype!r}")
        max_slots = _positive_int("max_slots", max_slots)
        if max_tables is None:
            max_tables = min(max(64, max_blocks), 4096)
        max_tables = _positive_int("max_tables", max_tables)
        if max_refs is None:
            max_refs = L.default_max_refs(max_blocks, max_tables)
        max_refs = _positive_int("max_refs", max_refs)
        given = dict(block_size=block_size, max_blocks=max_blocks, num_layers=num_layers,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, max_slots=max_slots,
                     max_tables=max_tables, max_refs=max_refs)
        for k, (lo, hi) in L.PARAM_RANGES.items():
            if not lo <= given[k] <= hi:
                raise ValueError(f"{k} must be in [{lo}, {hi}], got {given[k]}")
        lay = L.compute_layout(block_size, max_blocks, enable_caching, num_layers,
                               num_kv_heads, head_dim, dtype, max_slots, max_tables, max_refs)
        # Named from the start with magic, version and creator, so that an
        # attacher or `shmcache list/cleanup` recognises a pool being created
        # (or whose creator died creating it).
        pre = np.zeros(1, L.HEADER_DTYPE)
        pre["magic"], pre["version"] = L.MAGIC, L.LAYOUT_VERSION
        pre["creator_pid"] = os.getpid()
        pre["creator_start"] = process_start_time(os.getpid())
        fd = segment.create_file(name, lay.total_size, pre.tobytes(), private=private)
        try:
            mm = segment.map_fd(fd, lay.total_size)
            pool = cls(name, fd, mm, lay, creator=True, private=private)
            pool._initialise()
        except BaseException:
            if not private:
                segment.unlink(name)
            segment.creation_done(fd)   # the mapping keeps the description open
            os.close(fd)
            raise
        segment.creation_done(fd)
        pool._take_slot()
        return pool

    @classmethod
    def attach(cls, name: str, timeout: float = 5.0) -> "Pool":
        """Map the existing pool ``name`` and take a slot in it.

        Waits up to ``timeout`` seconds for a pool still being created.

        Raises:
            PoolNotFoundError: no such segment.
            UnsafePoolError: another user owns it, or others can write it.
            IncompatiblePoolError: not a pool, another layout version, or
                never initialised (its creator died); CorruptPoolError (a
                subclass): a header that does not describe this file.
        """
        fd = segment.open_file(name)
        try:
            hdr, size = segment.read_ready_header(fd, name, timeout)
            lay = L.layout_from_header(hdr, size, f"pool {name!r}")
            mm = segment.map_fd(fd, lay.total_size)
        except BaseException:
            os.close(fd)
            raise
        pool = cls(name, fd, mm, lay, creator=False, private=False)
        try:
            pool._take_slot()
        except BaseException:
            pool.unmap()
            raise
        return pool

    def _initialise(self) -> None:
        lay = self.layout
        h = self.header
        h["magic"] = L.MAGIC
        h["version"] = L.LAYOUT_VERSION
        for k in ("block_size", "max_blocks", "num_layers", "num_kv_heads", "head_dim",
                  "max_slots", "max_tables", "max_refs", "hash_capacity", "table_capacity"):
            h[k] = getattr(lay, k)
        h["enable_caching"] = int(lay.enable_caching)
        h["dtype_code"] = L.DTYPES[lay.dtype]
        h["creator_pid"] = os.getpid()
        h["creator_start"] = process_start_time(os.getpid())
        h["created_at"] = time.time()
        h["seed"] = np.frombuffer(os.urandom(16), "V16")[0]
        h["total_size"] = lay.total_size
        self._read_header()
        self.native.init_mutex()
        self.native.release()       # again, now that created_at is known
        self.native, self.ops = self._open_native()
        self.lock.native = self.native
        n = lay.max_blocks
        b = self.blocks
        ids = np.arange(n + 2, dtype=np.int32)
        b["prev"] = ids - 1
        b["next"] = ids + 1
        # free list: HEAD -> 1 -> ... -> n-1 -> TAIL; block 0 is the null block
        b["next"][self.HEAD] = 1
        b["prev"][1] = self.HEAD
        b["next"][n - 1] = self.TAIL
        b["prev"][self.TAIL] = n - 1
        b["prev"][self.HEAD] = -1
        b["next"][self.TAIL] = -1
        b["prev"][0] = b["next"][0] = -1
        b["ref_count"][0] = 1
        b["flags"][0] = L.FLAG_NULL
        counters = self.counters
        counters.num_free = n - 1
        # every chunk free: 0 -> 1 -> ... -> num_chunks-1, first ids -1
        km = self.kmat
        km[:, 0] = np.arange(1, lay.num_chunks + 1, dtype=np.int32)
        km[-1, 0] = -1
        km[:, 1] = -1
        counters.holder = -1
        counters.free_ref = 0
        counters.free_refs = lay.num_chunks
        self.hidx[:] = -1
        self.tidx[:] = -1
        h["checksum"] = np.frombuffer(L.header_checksum(h), "V16")[0]
        h["ready"] = 1

    def add_tokens(self, n: int) -> None:
        """The seed's token counter (``tokens``) += n: an atomic add where the
        C accelerator is, since appends without the lock add to it too
        (claims.py); a plain one in a pure process (none run then)."""
        self.ops.add_counter(_TOKENS_WORD, int(n))

    # ------------------------------------------------------------------ slots
    def _take_slot(self) -> None:
        with self.lock:
            if not (self.slots["state"] == 0).any() and not self.lock.keeps_dirty:
                # No free slot: release what dead holders left so their slots
                # can be reused (a clean pool only; a dirty one waits for repair).
                reclaim_dead_slots(self)
            self.slot_ops.claim(pure=not self.ops.native)
            self.slot = self.slot_ops.slot

    def release_slot(self) -> None:
        """Give this manager's slot back (``SlotOps.release``: under the
        lock, its holdings released first)."""
        self.slot_ops.release()
        self.slot = self.slot_ops.slot

    def _on_dirty(self):
        # The lock found the pool dirty (its previous holder died mid-update)
        # or corruption was met: rebuild the derived state from the lists,
        # then release what dead holders held. Managers see the epoch move
        # and re-read their process-local maps.
        if self.closed or self.slot_ops.slot < 0:
            # not repaired (closed, or still attaching: the repair is the
            # first attached holder's): the lock keeps the pool dirty
            return False
        logger.warning("pool %r: previous lock holder died mid-update; repairing", self.name)
        self.slot_ops.await_dead_holder()
        # NOTE: from here this process is the holder a repair would wait for:
        # if it dies in this hold (repairing, or in the op that follows, the
        # pool dirty all along), the next repair must wait for its liveness
        # byte, not the earlier holder's, whose slot this repair frees and a
        # new process may take (a wait on a live slot lasts its whole timeout)
        self.counters.holder = self.slot_ops.slot
        self._repairing = True      # (corruption met while repairing repairs nothing)
        try:
            recovery.repair(self)
            self.reclaimed_in_repair += reclaim_dead_slots(self)
        finally:
            self._repairing = False

    def corrupt(self, what: str) -> CorruptPoolError:
        """The error for a contradiction found in the shared state (``what``).

        Found under the lock by a manager, the derived state is rebuilt from
        the reference lists at once (``recovery.repair``, as after a holder's
        death), so the next call finds a consistent pool; otherwise the pool is left
        marked dirty for its next lock holder. The caller raises the error:
        the operation that met the corruption fails, clearly, and changes
        nothing more.
        """
        note = "its next lock holder rebuilds it"
        lock = self.lock
        if lock.held and lock.owned_here() and not self._repairing:
            try:
                if self._on_dirty() is not False:
                    note = "its derived state was rebuilt from the reference lists; retry the call"
                else:
                    lock.keep_dirty()           # left dirty when the lock is released
            except Exception as e:          # the repair itself failed: leave it dirty
                lock.keep_dirty()
                note = f"rebuilding it failed too ({type(e).__name__}: {e})"
        elif lock.held and lock.owned_here():
            lock.keep_dirty()                   # found by the repair itself
        return CorruptPoolError(f"pool {self.name!r} is corrupt: {what}; {note}")

    def check_usable(self) -> None:
        forked = self.slot_ops.forked
        if self.closed or (self.slot_ops.slot < 0 and self.lock.unusable and not forked):
            raise PoolClosedError(f"manager of pool {self.name!r} is closed")
        if forked:
            raise PoolClosedError(
                f"manager of pool {self.name!r} was inherited across fork; "
                "call shmcache.attach() in the child")

    def now(self) -> float:
        return time.time() - self.created_at

    def unmap(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.lock.unusable = True
        live_pools.discard(self)
        self.views.release()
        self.bind_views()
        self.native.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it
        if not self.slot_ops.forked:
            self.slot_ops.close()
            os.close(self.fd)

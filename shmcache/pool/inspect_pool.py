"""Read-only inspection of pool segments, for the ``shmcache`` command and tools.

A :class:`PoolView` maps a pool's metadata (never its KV arena) read-only and
takes no slot, so it works on a pool whose owner is dead without changing
anything in it but the lock word: snapshots are taken under the pool lock
when it can be had within a short wait, so the figures are consistent;
otherwise they are read as they are. (Taking the lock from a dead holder
marks the pool dirty, as any locker does, so the next manager repairs it.)

Liveness: the owner is the header's ``creator_pid`` whose process start time
equals ``creator_start``; an attached manager is a slot in state 1 whose
liveness byte is OFD-locked by some open file description.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import Any

import numpy as np
import psutil

from ..shm import layout as L
from ..shm import claims, segment
from . import recovery, reserve
from ..shm.slots import UNRECORDED_OWNER_S, lock_owner_problem, thread_status
from ..errors import CorruptPoolError, IncompatiblePoolError
from ..shm.counters import Counters
from ..shm.lock import MUTEX_MAP_SIZE, open_mutex
from ..system.platform import byte_held_by_other
from .pool import MappedViews, block_usage, prefix_hit_rate  # noqa: F401 (named here too)

STAT_KEYS = ("allocated_blocks", "free_blocks", "shared_blocks", "cached_blocks",
             "total_tokens_cached", "tokens_held", "cache_hits", "cache_misses",
             "prefix_hit_rate", "cow_copies", "evictions", "refs_held", "max_refs",
             "block_tables", "max_tables", "attached", "max_slots")


def process_alive(pid: int, start_time: float) -> bool:
    """Whether process ``pid`` exists and started at ``start_time`` (not a reused
    pid). A zombie (exited, not yet reaped by its parent) is dead: it runs no
    code and holds no file, lock or mapping."""
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        ct = proc.create_time()
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # exists, owned by someone else: assume it is the one
    return start_time <= 0 or abs(ct - start_time) < 0.05


def _loose_and_reserved(slots, s: int) -> dict:
    # (a reserve's blocks are loose references, but free)
    res = max(0, int(slots["reserved"][s]))
    return {"loose_blocks": int(slots["loose_count"][s]) - res, "reserved_blocks": res}


class PoolView:
    """Read-only view of the pool ``name``.

    Raises:
        PoolNotFoundError: no such segment.
        UnsafePoolError: another user owns it, or others can write it.
        IncompatiblePoolError: not a shmcache pool, another layout version, or
            (with ``require_ready``) not initialised; CorruptPoolError: a
            header that does not describe the file.
    """

    def __init__(self, name: str, require_ready: bool = True) -> None:
        self.name = name
        self.path = segment.path_for(name)
        self.fd = segment.open_file(name, readonly_ok=True)
        self.mm: Any = None          # the metadata, mapped read-only once ready
        self._lock_mm = self._lock = None
        try:
            self._read_header(require_ready)
        except BaseException:
            os.close(self.fd)
            raise

    def _read_header(self, require_ready: bool) -> None:
        self.layout: Any = None      # the Layout once the header is ready (None before)
        self.ready = False
        self.creating = False
        try:
            h, self.size = segment.read_ready_header(self.fd, self.name)
        except IncompatiblePoolError:
            # a pool being created, or whose creator died creating it
            h, self.size = segment.read_header(self.fd)
            if (require_ready or h is None or bytes(h["magic"]) != L.MAGIC
                    or int(h["version"]) != L.LAYOUT_VERSION):
                raise
            self.creating = segment.being_created(self.fd)
        else:
            self.ready = True
        self.hdr = h
        self.owner_pid = int(h["creator_pid"])
        self.owner_start = float(h["creator_start"])
        self.created_at = float(h["created_at"])
        if not self.ready:
            return
        lay = self.layout = L.layout_from_header(h, self.size, f"pool {self.name!r}")
        self.mm = mmap.mmap(self.fd, lay.arena_off, mmap.MAP_SHARED, mmap.PROT_READ)
        self.counter_array = np.frombuffer(self.mm, np.int64, L.NUM_COUNTERS, lay.counters_off)
        # the same by name, over the read-only mapping: read, never written
        self.counters = Counters.from_address(self.counter_array.ctypes.data)
        self.slots = np.frombuffer(self.mm, L.SLOT_DTYPE, lay.max_slots, lay.slots_off)
        self.blocks = np.frombuffer(self.mm, L.BLOCK_DTYPE, lay.max_blocks + 2, lay.blocks_off)
        self.tables = np.frombuffer(self.mm, L.TABLE_DTYPE, lay.max_tables, lay.tables_off)

    # ------------------------------------------------------------ liveness
    def owner_alive(self) -> bool:
        return process_alive(self.owner_pid, self.owner_start)

    def slot_alive(self, slot: int) -> bool:
        return byte_held_by_other(self.fd, L.LIVENESS_OFF + slot)

    def live_slots(self) -> list:
        if self.layout is None:
            return []
        return [int(s) for s in np.flatnonzero(self.slots["state"] == 1) if self.slot_alive(int(s))]

    # ------------------------------------------------------------ snapshots
    @contextlib.contextmanager
    def locked(self, timeout: float = 1.0):
        """Hold the pool lock if it comes within ``timeout``.

        Yields True if held, False if the snapshot is taken unlocked (also
        when the file is read-only to us, or not initialised).
        """
        m = self._mutex()
        if m is None:
            yield False
            return
        deadline = time.monotonic() + timeout
        while m.trylock() < 0:
            if time.monotonic() >= deadline:
                yield False
                return
            time.sleep(0.002)
        try:
            yield True
        finally:
            m.unlock()

    def _mutex(self):
        if self._lock_mm is None:
            if not self.ready or self.size < MUTEX_MAP_SIZE:
                return None
            try:
                self._lock_mm = mmap.mmap(self.fd, MUTEX_MAP_SIZE)
            except (OSError, ValueError):
                return None         # opened read-only
            self._lock = open_mutex(self._lock_mm)
        return self._lock

    def lock_word(self) -> int:
        return int(np.frombuffer(self.mm, np.uint32, 1, L.MUTEX_OFF)[0])

    def recorded_holder_pid(self):
        s = int(self.counters.holder)
        if 0 <= s < self.layout.max_slots and self.slots["state"][s] == 1 and self.slot_alive(s):
            return int(self.slots["pid"][s])
        return None

    def lock_word_problem(self, watch: float = UNRECORDED_OWNER_S):
        """Why the lock word cannot be a hold (``lock_owner_problem``),
        once it stayed so, unchanged, for ``watch`` seconds (a hold without a
        recorded holder lasts milliseconds); None at once when it names
        nobody or may be a hold."""
        w = self.lock_word()
        t0 = time.monotonic()
        while True:
            held = time.monotonic() - t0
            if self.lock_word() != w or not lock_owner_problem(
                    w, self.recorded_holder_pid(), max(held, UNRECORDED_OWNER_S)):
                return None
            if held >= watch:
                return lock_owner_problem(w, self.recorded_holder_pid(),
                                          max(held, UNRECORDED_OWNER_S))
            time.sleep(0.02)

    def stuck_claims(self, watch: float = claims.CLAIM_STUCK_S) -> list:
        """Problem lines for table claims that name a live slot and stay
        unchanged for ``watch`` seconds (``claims.stuck_claims``)."""
        live = lambda s: (0 <= s < self.layout.max_slots and self.slots["state"][s] == 1
                          and self.slot_alive(s))
        return claims.stuck_claim_lines(self, claims.stuck_claims(self.tables["claim"], live,
                                                                  watch))

    def stats(self) -> dict:
        s = recovery.scan_stats(self)
        k = self.counters
        hits, misses = int(k.hits), int(k.misses)
        s.update(cache_hits=hits, cache_misses=misses, prefix_hit_rate=prefix_hit_rate(hits, misses),
                 cow_copies=int(k.cow), evictions=int(k.evictions))
        s["usage"] = s["allocated_blocks"] / s["total_blocks"]
        s.update(self._block_usage())
        return s

    def _block_usage(self) -> dict:
        """``block_usage`` of the pool's blocks (referenced, cached, free)."""
        n = self.layout.max_blocks
        return block_usage(self.blocks["ref_count"][:n], self.blocks["flags"][:n])

    def l2_counters(self) -> dict:
        """The pool-wide L2 counters (``layout.L2_COUNTERS``: every process's
        L2 tier adds to them), as ``PagedCacheManager.l2_counters``."""
        return self.counters.l2()

    def holdings(self) -> list:
        out = []
        t = self.tables
        live_t = t["state"] == 1
        for s in np.flatnonzero(self.slots["state"] == 1).tolist():
            mine = np.flatnonzero(live_t & (t["owner"] == s))
            out.append({"slot": s, "pid": int(self.slots["pid"][s]),
                        "start_time": float(self.slots["start_time"][s]),
                        "alive": self.slot_alive(s), "tables": int(mine.size),
                        "table_blocks": int(t["length"][mine].sum()),
                        **_loose_and_reserved(self.slots, s)})
        return out

    def snapshot(self) -> dict:
        """Everything ``shmcache inspect`` shows, as one JSON-able dict."""
        lay = self.layout
        with self.locked() as consistent:
            d = {"name": self.name, "path": self.path, "owner_pid": self.owner_pid,
                 "owner_alive": self.owner_alive(), "created_at": self.created_at,
                 "size_bytes": self.size, "consistent_snapshot": consistent}
            d.update(self.stats())
            k = self.counters
            d.update(block_tables=int(k.num_tables), ops=int(k.ops),
                     recoveries=int(k.recoveries), reclaimed_refs=int(k.reclaimed),
                     max_lock_wait_s=int(k.lock_wait_ns) / 1e9,
                     lock_turns=int(k.turn_next), lock_queue=k.lock_queue,
                     dirty=bool(k.dirty), free_ref_chunks=int(k.free_refs))
            if not consistent:
                # held past the wait: say by whom, and whether it can be a hold
                w = self.lock_word()
                st = thread_status(w & 0x3FFFFFFF) if w & 0x3FFFFFFF else None
                d["lock_owner"] = {"word": w, "tid": w & 0x3FFFFFFF,
                                   "pid": st[0] if st else None,
                                   "problem": self.lock_word_problem(watch=1.0)}
            d["l2"] = self.l2_counters()
            d["layout"] = {k: getattr(lay, k) for k in lay.__dataclass_fields__}
            d["layout"]["block_bytes"] = lay.block_bytes
            d["holders"] = self.holdings()
        return d

    def fsck(self, settle: float = 1.0) -> dict:
        """The invariant check of ``shmcache fsck`` without ``--repair``,
        changing nothing: no slot, no lock, no recovery (the segment is
        mapped read-only). The check runs on a private copy of the metadata,
        taken while no lock holder changes it: a copy is kept when the pool
        was clean before and after it and no operation ended meanwhile (every
        holder marks the pool dirty while inside and counts its operation on
        leaving), or, in a pool left dirty, when nothing changed for 20 ms.
        After ``settle`` seconds without such a moment the last copy is used
        (``stable`` False).

        Returns:
            {"problems": [...], "dirty": bool, "stable": bool, "stats":
            recovery.scan_stats of the copy, "tables": int, "holders":
            [holdings]}.
        """
        lay, k = self.layout, self.counters
        deadline = time.monotonic() + settle
        while True:
            d0, o0 = int(k.dirty), int(k.ops)
            data = bytes(self.mm[:lay.arena_off])
            d1, o1 = int(k.dirty), int(k.ops)
            stable = o0 == o1 and d0 == d1 == 0
            if not stable and o0 == o1 and d0 == d1:
                time.sleep(0.02)
                stable = (int(k.ops) == o0 and int(k.dirty) == d0
                          and bytes(self.mm[:lay.arena_off]) == data)
            if stable or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        snap = snapshot_views(self.name, lay, bytearray(data))
        problems = recovery.check(snap)
        # what a copy cannot show: a claim or a lock word that does not move
        problems += self.stuck_claims()
        why = self.lock_word_problem()
        if why:
            problems.append(f"the pool lock's word is no hold: {why} (the next locker takes it "
                            "over after a few seconds; fsck --repair does)")
        holders = []
        t = snap.tables
        live_t = t["state"] == 1
        for s in np.flatnonzero(snap.slots["state"] == 1).tolist():
            mine = np.flatnonzero(live_t & (t["owner"] == s))
            holders.append({"slot": s, "pid": int(snap.slots["pid"][s]),
                            "alive": self.slot_alive(s), "tables": int(mine.size),
                            "table_blocks": int(t["length"][mine].sum()),
                            **_loose_and_reserved(snap.slots, s)})
        return {"problems": problems, "dirty": bool(snap.counters.dirty), "stable": stable,
                "stats": recovery.scan_stats(snap), "tables": int(snap.counters.num_tables),
                "holders": holders}

    def summary(self) -> dict:
        """The few figures ``shmcache list`` shows."""
        d = {"name": self.name, "owner_pid": self.owner_pid, "owner_alive": self.owner_alive(),
             "size_bytes": self.size, "ready": self.ready, "creating": self.creating}
        if self.layout is not None:
            n = self.layout.max_blocks
            d.update(max_blocks=n, block_size=self.layout.block_size,
                     allocated_blocks=n - int(self.counters.num_free) - reserve.reserved_total(self),
                     cached_blocks=self._block_usage()["blocks_cached"],
                     attached=len(self.live_slots()))
            d["usage"] = d["allocated_blocks"] / n
        return d

    def close(self) -> None:
        for k in ("counter_array", "counters", "c", "slots", "blocks", "tables"):
            self.__dict__.pop(k, None)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            self._lock_mm.close()
            self._lock_mm = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "PoolView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def snapshot_views(name: str, lay: L.Layout, data: bytearray) -> MappedViews:
    """A Pool's views over a private copy of a pool's metadata (no arena),
    for ``recovery.check``: corruption met reading it is only reported."""
    def corrupt(what: str) -> CorruptPoolError:
        return CorruptPoolError(f"pool {name!r} is corrupt: {what}")
    return MappedViews(data, lay, corrupt, arena=False)


def removal_verdict(view: PoolView):
    """(removable, reason): removable only if the owner is dead and no live
    process is attached (call with the pool lock held exclusively)."""
    if view.owner_alive():
        return False, f"owner pid {view.owner_pid} is alive"
    live = view.live_slots()
    if live:
        pids = sorted({int(view.slots["pid"][s]) for s in live})
        return False, f"owner pid {view.owner_pid} is dead but {len(live)} live process(es) attached (pids {pids})"
    return True, f"owner pid {view.owner_pid} is dead and no live process is attached"


def cleanup(name: str):
    """Unlink pool ``name`` if it is dead; (removed, reason).

    Holds the pool lock exclusively while deciding, so no manager is in the
    middle of an operation; a process that opened the file before the unlink
    and attaches afterwards keeps a private, orphaned copy.
    """
    with PoolView(name, require_ready=False) as v:
        if not v.ready:
            # never initialised: no lock or slots to look at yet
            if v.creating:
                return False, "it is being created"
            ok, why = removal_verdict(v)
            if ok:
                segment.unlink(name)
                why = f"never initialised: its creator (pid {v.owner_pid}) died creating it"
            return ok, why
        with v.locked(timeout=2.0) as held:
            if not held:
                return False, "its lock is held by a live process"
            ok, why = removal_verdict(v)
            if ok:
                segment.unlink(name)
            return ok, why

"""Slots: the identity a manager holds references under, and whether the
process behind each one is alive.

A manager attached to a pool holds one slot of the slot table
(``layout.SLOT_DTYPE``: pid, start time, attach time, state, the head and
length of its loose list). Its process is alive exactly while the OFD lock
on the slot's liveness byte (``layout.LIVENESS_OFF + slot``) is held: the
kernel drops that lock with the last reference to its open file
description, so "is that byte held?" answers "is the holder alive?", and
the pid and start time are only for display.

The lock is taken on a second open file description of the segment
(``liveness_fd``), never mapped, so that a forked child can drop its copy:
this module also keeps the pools this process has mapped (``live_pools``)
and, after a fork, makes the child's copies unusable (the child must
attach on its own). ``reclaim`` reads ``live_pools`` too, to see whether
this thread holds a segment's lock through another manager.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Optional, Tuple

import numpy as np
import psutil

from . import claims
from . import layout as L
from ..errors import CapacityError
from ..system.platform import byte_held_by_other, byte_lock, byte_unlock

logger = logging.getLogger("shmcache.manager.paged_cache")

live_pools: "weakref.WeakSet" = weakref.WeakSet()   # every mapped Pool of this process


def _after_fork_in_child() -> None:
    # The child shares the parent's open file descriptions, so its liveness
    # byte would be the parent's. It must attach() on its own.
    for p in list(live_pools):
        p.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def liveness_fd(fd: int) -> int:
    """A second open file description of the segment ``fd``, never mmapped,
    to carry this manager's liveness byte (an mmap keeps a dup of the fd it
    maps, and a forked child would keep that one too)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return fd


# How long the pool lock's word may name one live process that is not the
# pool's recorded holder before the word is taken for a corrupted one. The
# holds that record no holder (an attacher taking its slot, ``shmcache
# inspect``'s snapshot, ``cleanup`` deciding) last milliseconds; a holder with
# a slot records itself (C_HOLDER) on entry, or, finding the pool dirty,
# after waiting up to 2 s for the dead holder (``_await_dead_holder``).
UNRECORDED_OWNER_S = 3.0

_TID_MASK, _OWNER_DIED = 0x3FFFFFFF, 0x40000000


def thread_status(tid: int):
    """(tgid, state letter) of thread ``tid`` from /proc, or None if there
    is no such thread."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    except OSError:
        return (tid, "?")       # exists, unreadable
    tgid, state = tid, "?"
    for line in text.splitlines():
        if line.startswith("Tgid:"):
            tgid = int(line.split()[1])
        elif line.startswith("State:"):
            state = line.split()[1]
    return tgid, state


def lock_owner_problem(word: int, holder_pid, held_s: float):
    """Why the pool lock's word ``word`` cannot be a hold, or None when it
    may be one (or names nobody).

    ``holder_pid``: the pid of the recorded holder (C_HOLDER's slot, when
    that slot is attached and alive), else None; ``held_s``: how long the
    word has stayed ``word``. A thread that no longer exists or is a zombie
    holds nothing (had it died holding the lock, the kernel would have
    marked the word). A live process that is not the recorded holder may
    hold the lock only briefly (``UNRECORDED_OWNER_S``): a process that
    never attached cannot hold it longer.
    """
    tid = word & _TID_MASK
    if not tid or word & _OWNER_DIED:
        return None
    st = thread_status(tid)
    if st is None:
        return f"it names thread {tid}, which does not exist"
    tgid, state = st
    if state in ("Z", "X"):
        return f"it names thread {tid} of process {tgid}, which is a zombie"
    if held_s >= UNRECORDED_OWNER_S and tgid != holder_pid:
        return (f"it names thread {tid} of live process {tgid}, which has not been the "
                f"pool's recorded lock holder for {held_s:.1f} s (never attached, or a "
                "corrupted word)")
    return None


def process_start_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0


class SlotOps:
    """This manager's slot in a pool's slot table (``slot``, -1 while it
    has none), the liveness byte that says it is alive, and whether the
    processes behind other slots are alive.

    It owns ``slot``, the liveness file description (``live_fd``: a second
    open file description of the segment, ``liveness_fd``), whether this
    mapping was inherited across a fork, and the lock word seen stuck.
    Its collaborators, given to the constructor: the pool's name, segment
    fd and layout; its views (``pool.MappedViews``, or any object with
    ``slots``, the slot table, and ``counters``, a ``counters.Counters``);
    and its ``lock`` (``PoolLock``: its ``slot`` is kept equal to ``slot``,
    and its ``native`` is the mutex the lock word is read through).

    Invariants: a slot is attached (state 1) from ``claim`` to ``release``,
    and its liveness byte is locked by its holder all that time; an
    attached slot whose byte is not held is dead, and is reused only after
    its holdings are released (``reclaim``), never with its references in
    it. Slots are claimed under the pool lock.
    """

    def __init__(self, name: str, fd: int, layout: Any, views: Any, lock: Any) -> None:
        self.name = name
        self.fd = fd
        self.layout = layout
        self.views = views
        self.lock = lock
        self.slot = -1
        self.live_fd = liveness_fd(fd)
        self._forked = False
        self._stuck_word: Optional[Tuple[int, float]] = None   # (lock word, when first seen)

    @property
    def forked(self) -> bool:
        """Whether this mapping was inherited by a forked child (which has no
        slot of its own: it must attach on its own)."""
        return self._forked

    def after_fork_in_child(self) -> None:
        """This process is a forked child: the mapping is no longer usable."""
        self._forked = True
        self.lock.unusable = True
        if self.live_fd >= 0 and self.live_fd != self.fd:
            # Drop the child's reference to the liveness description, so the
            # parent's death is seen even while this child lives (closing
            # never unlocks: the parent still holds the description).
            os.close(self.live_fd)
        self.live_fd = -1

    def liveness_offset(self, slot: int) -> int:
        return L.LIVENESS_OFF + slot

    def slot_alive(self, slot: int) -> bool:
        if slot == self.slot:
            return True
        return byte_held_by_other(self.fd, self.liveness_offset(slot))

    def dead_slots(self) -> list:
        st = self.views.slots["state"]
        return [int(s) for s in np.flatnonzero(st == 1) if not self.slot_alive(int(s))]

    def claim(self, pure: bool) -> None:
        """Take a free slot, recording whether this process runs without the
        C accelerator (``pure``). The caller holds the lock, and has
        reclaimed dead slots if none was free."""
        st = self.views.slots["state"]
        for s in np.flatnonzero(st == 0).tolist() + np.flatnonzero(st == 1).tolist():
            if st[s] == 1:
                # a dead holder's slot: reused only once reclaimed (by the
                # caller, or by the next reclaim), never with its references in it
                continue
            if byte_lock(self.live_fd, self.liveness_offset(s)):
                sl = self.views.slots[s]
                sl["pid"] = os.getpid()
                sl["start_time"] = process_start_time(os.getpid())
                sl["attached_at"] = time.time()
                sl["loose_head"] = -1
                sl["loose_count"] = 0
                sl["reserved"] = 0
                claims.attach_pure(self.views, int(s), pure)
                sl["state"] = 1
                self.slot = self.lock.slot = int(s)
                return
        raise CapacityError(
            f"pool {self.name!r} has no free slot: all {self.layout.max_slots} "
            "are attached by live processes (create it with a larger max_slots)")

    def release(self) -> None:
        """Give this manager's slot back (under the lock, its holdings
        released first)."""
        if self.slot >= 0:
            self.views.slots["state"][self.slot] = 0
            byte_unlock(self.live_fd, self.liveness_offset(self.slot))
            self.slot = self.lock.slot = -1

    def recorded_holder_pid(self):
        """The pid of the lock's recorded holder (C_HOLDER), if that slot is
        attached and alive; else None."""
        s = int(self.views.counters.holder)
        slots = self.views.slots
        if 0 <= s < self.layout.max_slots and slots["state"][s] == 1 and self.slot_alive(s):
            return int(slots["pid"][s])
        return None

    def on_stuck_lock_word(self) -> None:
        """The lock's word named one live thread for a second (PoolLock's
        wait): when it cannot be a hold (``lock_owner_problem``), mark its
        owner dead, so that the next lock attempt takes the lock as from a
        dead holder and repairs. Called without the lock."""
        native = self.lock.native
        w = int(native.lock_word())
        now = time.monotonic()
        first = self._stuck_word
        if first is None or first[0] != w:
            # (the native wait saw the word unchanged for a second already)
            self._stuck_word = first = (w, now - 1.0)
        why = lock_owner_problem(w, self.recorded_holder_pid(), now - first[1])
        if why and native.mark_owner_dead(w):
            self._stuck_word = None
            logger.warning("pool %r: the lock word is no hold (%s): taken over as from a "
                           "dead holder", self.name, why)

    def await_dead_holder(self, timeout: float = 2.0) -> None:
        """Wait (up to ``timeout``) for the recorded lock holder's liveness
        byte to drop (the lock found the pool dirty)."""
        # NOTE: the kernel hands a robust mutex on when its dying holder's
        # memory goes, a moment before its files (and liveness byte) close:
        # wait for that, so that the repair reclaims what the holder held.
        s = int(self.views.counters.holder)
        slots = self.views.slots
        if not 0 <= s < self.layout.max_slots or s == self.slot:
            return
        deadline = time.monotonic() + timeout
        while (slots["state"][s] == 1 and self.slot_alive(s)
               and time.monotonic() < deadline):
            time.sleep(0.001)

    def drop_liveness(self) -> None:
        """Leave as a death would: unlock this manager's liveness byte (its
        slot stays attached; whoever reclaims next releases its holdings)."""
        byte_unlock(self.live_fd, self.liveness_offset(self.slot))

    def close(self) -> None:
        """Close the liveness description (``Pool.unmap``, not after a
        fork: the child dropped its copy already)."""
        if self.live_fd >= 0 and self.live_fd != self.fd:
            os.close(self.live_fd)
        self.live_fd = -1

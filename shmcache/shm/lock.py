"""The pool lock: the mutex, its fast path, and the dirty mark.

The pool lock is the robust pthread mutex in the segment's header
(``platform.RobustMutex``, or the C accelerator ``_hot``, which drives the
same mutex and adds the fused allocate/free operations; ``open_hot``
chooses): free, it costs no system call; its holder's death hands it to the
next locker at once, so a SIGKILLed holder blocks nobody. A thread lock
orders the threads of one manager (the mutex belongs to the thread that took
it, and the thread lock makes that the thread that releases it).

NOTE: a holder that dies mid-update leaves half-linked lists behind. Every
holder sets the ``dirty`` counter when it takes the lock and clears it when
it leaves cleanly; whoever next takes the lock and finds it set runs
``on_dirty`` (a full rebuild of the derived state) before going on.

``open_hot(mm, layout)`` returns an object with ``init_mutex()``,
``trylock()``/``lock()`` (0 taken, 1 taken from a dead holder, -1 busy for
``trylock``; ``lock(True)`` -2, not taken, when the word named one live
thread for a second: ``PoolLock`` asks the pool to judge it, which may
``mark_owner_dead(lock_word())``), ``unlock()``, ``release()``,
``lock_slices()``, and ``alloc``
and ``free``: the fused operations of ``_hot`` (``_native/hot.cpp``, the
nanobind binding of the ``hot_*.h`` core), or None (then ``fastpath`` does
them in Python under the lock). ``_hot`` also has the table
operations ``table_new``, ``table_take``, ``table_append`` and ``table_drop`` and the prefix
lookup ``find_chain``, which run inside a hold of this lock (the reference mutex has none: callers look them
up with ``getattr`` and run the Python path without them). Set
``SHMCACHE_PURE=1`` to use the reference path even where ``_hot`` is built.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

from . import layout as L
from ..errors import CorruptPoolError, ShmCacheError
from ..system.platform import RobustMutex

# Exceptions our operations raise only before they change anything
# (check-then-commit), so the pool stays clean when they escape.
CLEAN_ERRORS = (ValueError, TypeError, KeyError, IndexError, ShmCacheError)


try:
    if os.environ.get("SHMCACHE_PURE"):
        raise ImportError("SHMCACHE_PURE is set")
    from .. import _hot
except ImportError:     # not compiled here: the ctypes path below
    _hot = None
if _hot is not None and getattr(_hot, "PARAM_NAMES", None) != L.HOT_PARAM_NAMES:
    # built from another layout.HOT_PARAMS: it would read the pool through
    # the wrong offsets; the reference path instead
    warnings.warn("shmcache._hot was built from another layout.HOT_PARAMS: not using it "
                  "(rebuild it: python setup.py build_ext --inplace)", RuntimeWarning,
                  stacklevel=1)
    _hot = None

ACCELERATED = _hot is not None


def open_hot(mm, lay, created_at: float):
    """The mutex (and fused operations) over mapping ``mm`` of a pool: the C
    accelerator's where it is built for this layout (and not switched off),
    else the reference mutex."""
    if ACCELERATED and _hot is not None:
        return _hot.Hot(mm, L.hot_params(lay), created_at)
    return reference_mutex(mm)


def reference_mutex(mm) -> RobustMutex:
    """The pool mutex of mapping ``mm`` through ``platform.RobustMutex`` (the
    reference path), whether or not ``_hot`` is built."""
    return RobustMutex(mm, L.MUTEX_OFF, L.HEADER_SIZE + 8 * L.C_DIRTY)


MUTEX_MAP_SIZE = L.HEADER_SIZE + L.COUNTERS_SIZE   # what open_mutex needs mapped


def open_mutex(mm):
    """Only the mutex (no fused operations), over a writable mapping of the
    segment's first ``MUTEX_MAP_SIZE`` bytes (the inspector's, the tests')."""
    if _hot is not None:
        # max_slots 0: the fused operations refuse every call
        return _hot.Hot(mm, L.hot_params_only(mutex_off=L.MUTEX_OFF, counters_off=L.HEADER_SIZE,
                                              c_dirty=L.C_DIRTY, c_holder=L.C_HOLDER))
    return reference_mutex(mm)


SPIN_TRIES = 200      # tries of a busy mutex before sleeping on it (see PoolLock._wait)


class PoolLock:
    """Reentrant inter-process lock over one pool, with a dirty mark.

    ``native`` is the pool's mutex (``open_hot``), ``counters`` its
    counters (``counters.Counters``). ``on_dirty`` runs with the lock held when the
    previous holder did not leave cleanly.
    """

    def __init__(self, native, counters, on_dirty) -> None:
        self.native = native
        self.slot = -1              # the pool's slot, recorded as the holder
        self._counters = counters
        self._on_dirty = on_dirty
        self._tlock = threading.RLock()
        self._depth = 0
        self._keep_dirty = 0
        self.check_usable: Any = None    # raises once the owner is closed or forked
        self.unusable = False       # set with it, so the hot path tests a flag
        self.wait_log = None        # a list to append each slow-path wait (ns) to
        self.trace = False          # trace each hold in the native trace (bench_scale --trace)
        self.claimed: list = []     # tables whose claim this hold took (claims.py)
        self.release_claims: Any = None  # gives them back (set by the pool)
        self.on_stuck: Any = None   # judges a lock word that names one live thread (the pool)
        self._asked = self._locked = 0

    def __enter__(self):
        self._tlock.acquire()
        if self._depth:
            self._depth += 1
            return self
        try:
            if self.unusable:
                # before the mutex: a closed manager's mapping may be gone,
                # and a forked child has no slot of its own
                self.check_usable()
            if self.trace:
                self._asked = time.monotonic_ns()
            if self.native.trylock() < 0:
                self._wait()
            if self.trace:
                self._locked = time.monotonic_ns()
        except BaseException:
            self._tlock.release()
            raise
        self._depth = 1
        k = self._counters          # (fields: as fast as indexing the words)
        if k.dirty:
            self._dirty_on_entry()
        else:
            # (a dirty pool keeps the holder that left it so: repair waits for it)
            k.holder = self.slot
            self._keep_dirty = 0
            k.dirty = 1
        return self

    def _wait(self) -> None:
        # NOTE: spin first, as the fused C calls do: a hold is a few
        # microseconds, while sleeping in futex() and being woken costs tens
        # of them and lets a convoy form. Bounded (SPIN_TRIES, about 20 µs):
        # the holder may be descheduled, or a thread of this process that
        # needs the GIL we hold. The spin counts as waiting (wait_log,
        # C_LOCK_WAIT_NS).
        t0 = time.perf_counter_ns()
        trylock = self.native.trylock
        for _ in range(SPIN_TRIES):
            if trylock() >= 0:
                break
        else:
            # -2: the word named one live thread for a second; the pool
            # judges whether that can be a hold (slots.lock_owner_problem)
            while self.native.lock(self.on_stuck is not None) < 0:
                self.on_stuck()
        waited = time.perf_counter_ns() - t0
        if self.wait_log is not None:
            self.wait_log.append(waited)
        self._counters.note_lock_wait(waited)

    def _dirty_on_entry(self) -> None:
        try:
            # False: nobody could repair yet (a manager still attaching)
            self._keep_dirty = int(self._on_dirty() is False)
        except BaseException:
            # Still dirty: the next holder repairs. Never keep the lock.
            self._depth = 0
            try:
                if self.claimed:
                    self.release_claims()
                self._unlock()
            finally:
                self._tlock.release()
            raise
        self._counters.mark_dirty()

    def __exit__(self, et, ev, tb):
        d = self._depth - 1
        self._depth = d
        if d:
            self._tlock.release()
            return False
        try:
            if et is not None and not issubclass(et, CLEAN_ERRORS):
                # Interrupted mid-update (KeyboardInterrupt, a bug):
                # repair now, while we still hold the lock.
                self._on_dirty()
            k = self._counters
            k.ops += 1              # a hold that ended cleanly
            k.dirty = self._keep_dirty
            if not self._keep_dirty:
                # no holder now (a dirty pool keeps the one that left it so)
                k.holder = -1
        finally:
            try:
                if self.claimed:
                    self.release_claims()
                self._unlock()
            finally:
                if self.trace:
                    self.native.trace_hold(self._asked, self._locked, time.monotonic_ns())
                self._tlock.release()
        return False

    def _unlock(self) -> None:
        try:
            self.native.unlock()
        except PermissionError:
            # EPERM: the lock word no longer names this thread: it was
            # overwritten while held (and the lock maybe taken over as from
            # a dead holder). This hold may have overlapped another: the
            # next holder repairs.
            self._counters.mark_dirty()
            raise CorruptPoolError(
                "the pool lock was taken from this process while it held it (its lock word "
                "was overwritten); the pool is marked for repair by its next lock holder"
            ) from None

    @property
    def held(self) -> bool:
        return self._depth > 0

    def owned_here(self) -> bool:
        """Whether this thread holds the lock, or is taking it (it holds
        ``_tlock`` from the start of ``__enter__``). RLock's own ownership
        test, asked on slow paths only: a hold pays nothing for it."""
        return self._tlock._is_owned()

    def keep_dirty(self) -> None:
        """Leave the pool marked dirty when this hold ends (lock held): its
        next holder repairs it."""
        self._keep_dirty = 1

    @property
    def keeps_dirty(self) -> bool:
        """Whether this hold leaves the pool marked dirty."""
        return bool(self._keep_dirty)

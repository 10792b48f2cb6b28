"""The pool mutex, through the C accelerator or, where it is not built, ctypes.

The pool lock is a process-shared, robust, error-checking pthread mutex at
``layout.MUTEX_OFF`` of the segment. Both implementations below drive the
same mutex, so processes with and without the accelerator exclude each
other. ``open_hot(pool)`` returns an object with:

- ``init_mutex()``: initialise it (the creator, before the header is ready);
- ``trylock() -> int`` and ``lock() -> int``: 0 when taken, 1 when taken
  from a holder that died (already made consistent, and the pool marked
  dirty so that the holder repairs and reclaims), and ``trylock`` returns -1
  when busy; ``lock`` waits with the GIL released;
- ``unlock()``; ``release()`` (drop the buffer export before unmapping);
- ``alloc`` and ``free``: the fused operations of ``_hot.c``, or None (then
  ``fastpath`` does them in Python under the lock).

NOTE: the kernel hands a robust mutex to the next locker as soon as its
holder dies (the thread's robust list is walked at exit), so a SIGKILLed
holder blocks nobody, and a reused pid cannot be taken for the holder. Set
``SHMCACHE_PURE=1`` to use ctypes and Python even where ``_hot`` is built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from . import layout as L

try:
    if os.environ.get("SHMCACHE_PURE"):
        raise ImportError("SHMCACHE_PURE is set")
    from . import _hot
except ImportError:     # not compiled here: the ctypes path below
    _hot = None

ACCELERATED = _hot is not None


def hot_params(lay) -> tuple:
    """The byte offsets ``_hot.Hot`` works with, in its ``P_*`` order."""
    bf, rf, sf = L.BLOCK_DTYPE.fields, L.REF_DTYPE.fields, L.SLOT_DTYPE.fields
    return (L.MUTEX_OFF, lay.counters_off,
            lay.blocks_off, L.BLOCK_DTYPE.itemsize, bf["ref_count"][1], bf["prev"][1],
            bf["next"][1], bf["flags"][1], bf["token_count"][1], bf["last_access"][1],
            lay.refs_off, L.REF_DTYPE.itemsize, rf["block_id"][1], rf["next"][1],
            lay.slots_off, L.SLOT_DTYPE.itemsize, sf["loose_head"][1], sf["loose_count"][1],
            lay.max_blocks, lay.max_slots, L.FLAG_CACHED,
            L.C_DIRTY, L.C_NUM_FREE, L.C_FREE_REF, L.C_FREE_REFS, L.C_OPS, L.C_EPOCH,
            L.C_HOLDER)


def open_hot(mm, lay, created_at: float, accelerated: bool = ACCELERATED):
    """The mutex (and fused operations) over mapping ``mm`` of a pool."""
    if accelerated and _hot is not None:
        return _hot.Hot(mm, hot_params(lay), created_at)
    return CtypesMutex(mm)


MUTEX_MAP_SIZE = L.HEADER_SIZE + L.COUNTERS_SIZE   # what open_mutex needs mapped


def open_mutex(mm):
    """Only the mutex (no fused operations), over a writable mapping of the
    segment's first ``MUTEX_MAP_SIZE`` bytes (the inspector's, the tests')."""
    if _hot is not None:
        params = [0] * 28
        params[0], params[1] = L.MUTEX_OFF, L.HEADER_SIZE
        params[21], params[27] = L.C_DIRTY, L.C_HOLDER     # P_C_DIRTY, P_C_HOLDER
        return _hot.Hot(mm, tuple(params))
    return CtypesMutex(mm)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_PSHARED, _ROBUST, _ERRORCHECK = 1, 1, 2     # PTHREAD_PROCESS_SHARED, ..._ROBUST, ..._ERRORCHECK


class CtypesMutex:
    """The same mutex through libc's pthread calls (ctypes releases the GIL
    around each foreign call, so ``lock`` waits without blocking threads)."""

    alloc = free = None

    def __init__(self, mm) -> None:
        self._anchor = ctypes.c_char.from_buffer(mm, L.MUTEX_OFF)
        self._m = ctypes.c_void_p(ctypes.addressof(self._anchor))
        self._dirty = ctypes.c_int64.from_buffer(mm, L.HEADER_SIZE + 8 * L.C_DIRTY)

    def init_mutex(self) -> None:
        attr = ctypes.create_string_buffer(64)
        for fn, *a in ((_libc.pthread_mutexattr_init,),
                       (_libc.pthread_mutexattr_setpshared, _PSHARED),
                       (_libc.pthread_mutexattr_setrobust, _ROBUST),
                       (_libc.pthread_mutexattr_settype, _ERRORCHECK)):
            e = fn(attr, *a)
            if e:
                raise OSError(e, os.strerror(e))
        e = _libc.pthread_mutex_init(self._mutex(), attr)
        if e:
            raise OSError(e, os.strerror(e))

    def _mutex(self):
        if self._m is None:
            raise ValueError("pool mapping already released")
        return self._m

    def _taken(self, e: int, busy_ok: bool) -> int:
        if e == 0:
            return 0
        if e == errno.EOWNERDEAD:
            # as _hot's owner_died: usable again, and the next holder repairs
            _libc.pthread_mutex_consistent(self._mutex())
            self._dirty.value = 1
            return 1
        if busy_ok and e in (errno.EBUSY, errno.EDEADLK):   # as _hot's trylock
            return -1
        raise OSError(e, os.strerror(e))

    def trylock(self) -> int:
        return self._taken(_libc.pthread_mutex_trylock(self._mutex()), True)

    def lock(self) -> int:
        return self._taken(_libc.pthread_mutex_lock(self._mutex()), False)

    def unlock(self) -> None:
        e = _libc.pthread_mutex_unlock(self._mutex())
        if e:
            raise OSError(e, os.strerror(e))

    def release(self) -> None:
        self._m = None
        self._anchor = self._dirty = None

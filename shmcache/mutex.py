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

NOTE: no wait on the mutex is unbounded: ``lock`` sleeps at most 10 ms at a
time and then looks at the lock word again, because a waiter can otherwise
sleep forever on a free lock (glibc wakes one waiter at unlock; if that one
is SIGKILLed before it runs while a third process took the lock by CAS, or
an unlocker dies between clearing the word and the wake, nobody wakes the
rest). ``lock_slices()`` counts the slices that ran out.

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


# The parameters of ``_hot.Hot``, in its ``P_*`` order.
_P_NAMES = ("mutex_off", "counters_off",
            "blocks_off", "block_size", "b_ref", "b_prev", "b_next", "b_flags", "b_tok", "b_last",
            "refs_off", "ref_size", "r_block", "r_next",
            "slots_off", "slot_size", "s_head", "s_count",
            "max_blocks", "max_slots", "flag_cached",
            "c_dirty", "c_num_free", "c_free_ref", "c_free_refs", "c_ops", "c_epoch", "c_holder")


def _params(**kw) -> tuple:
    return tuple(kw.pop(k, 0) for k in _P_NAMES)


def hot_params(lay) -> tuple:
    """The byte offsets ``_hot.Hot`` works with."""
    bf, rf, sf = L.BLOCK_DTYPE.fields, L.REF_DTYPE.fields, L.SLOT_DTYPE.fields
    return _params(
        mutex_off=L.MUTEX_OFF, counters_off=lay.counters_off,
        blocks_off=lay.blocks_off, block_size=L.BLOCK_DTYPE.itemsize,
        b_ref=bf["ref_count"][1], b_prev=bf["prev"][1], b_next=bf["next"][1],
        b_flags=bf["flags"][1], b_tok=bf["token_count"][1], b_last=bf["last_access"][1],
        refs_off=lay.refs_off, ref_size=L.REF_DTYPE.itemsize,
        r_block=rf["block_id"][1], r_next=rf["next"][1],
        slots_off=lay.slots_off, slot_size=L.SLOT_DTYPE.itemsize,
        s_head=sf["loose_head"][1], s_count=sf["loose_count"][1],
        max_blocks=lay.max_blocks, max_slots=lay.max_slots, flag_cached=L.FLAG_CACHED,
        c_dirty=L.C_DIRTY, c_num_free=L.C_NUM_FREE, c_free_ref=L.C_FREE_REF,
        c_free_refs=L.C_FREE_REFS, c_ops=L.C_OPS, c_epoch=L.C_EPOCH, c_holder=L.C_HOLDER)


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
        # max_slots 0: the fused operations refuse every call
        return _hot.Hot(mm, _params(mutex_off=L.MUTEX_OFF, counters_off=L.HEADER_SIZE,
                                    c_dirty=L.C_DIRTY, c_holder=L.C_HOLDER))
    return CtypesMutex(mm)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_CLOCK_MONOTONIC = 1
LOCK_SLICE_S = 0.010     # the longest one futex sleep on the pool lock lasts
DEAD_OWNER_SLICES = 100  # slices naming one owner before asking if it exists


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

_PSHARED, _ROBUST, _ERRORCHECK = 1, 1, 2     # PTHREAD_PROCESS_SHARED, ..._ROBUST, ..._ERRORCHECK


class CtypesMutex:
    """The same mutex through libc's pthread calls (ctypes releases the GIL
    around each foreign call, so ``lock`` waits without blocking threads)."""

    alloc = free = None

    def __init__(self, mm) -> None:
        self._anchor = ctypes.c_char.from_buffer(mm, L.MUTEX_OFF)
        self._m = ctypes.c_void_p(ctypes.addressof(self._anchor))
        self._dirty = ctypes.c_int64.from_buffer(mm, L.HEADER_SIZE + 8 * L.C_DIRTY)
        self._word = ctypes.c_uint32.from_buffer(mm, L.MUTEX_OFF)    # glibc's lock word

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
        # As _hot's lock_bounded: no futex sleep longer than LOCK_SLICE_S, so
        # a wake-up lost to a killed waiter or unlocker costs one slice.
        m = self._mutex()
        ts = _Timespec()
        last, same = None, 0
        while True:
            _libc.clock_gettime(_CLOCK_MONOTONIC, ctypes.byref(ts))
            ns = ts.tv_nsec + int(LOCK_SLICE_S * 1e9)
            ts.tv_sec += ns // 1_000_000_000
            ts.tv_nsec = ns % 1_000_000_000
            e = _libc.pthread_mutex_clocklock(m, _CLOCK_MONOTONIC, ctypes.byref(ts))
            if e != errno.ETIMEDOUT:
                return self._taken(e, False)
            CtypesMutex.slices += 1
            w = self._word.value
            same = same + 1 if w == last else 0
            last = w
            if same >= DEAD_OWNER_SLICES:      # as _hot's owner_vanished
                self._owner_vanished(w)
                same = 0

    def _owner_vanished(self, w: int) -> None:
        tid = w & 0x3FFFFFFF
        if not tid or w & 0x40000000:
            return
        try:
            os.kill(tid, 0)
            return
        except ProcessLookupError:
            pass
        except OSError:
            return
        # NOTE: ctypes has no compare-and-swap, so this is a store after a
        # re-read: the named holder is dead, so only a waiter that takes the
        # lock in the few instructions between could have changed the word.
        # The C accelerator (the normal path) uses a real CAS.
        if self._word.value == w:
            self._word.value = (w & 0x80000000) | 0x40000000

    slices = 0          # timed-lock slices that ran out in this process (a test hook)

    def lock_slices(self) -> int:
        return CtypesMutex.slices

    def unlock(self) -> None:
        e = _libc.pthread_mutex_unlock(self._mutex())
        if e:
            raise OSError(e, os.strerror(e))

    def release(self) -> None:
        self._m = None
        self._anchor = self._dirty = self._word = None

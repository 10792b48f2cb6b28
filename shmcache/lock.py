"""The pool lock and the liveness bytes.

The pool lock is the robust pthread mutex in the segment's header (see
``mutex``): free, it costs no system call; its holder's death hands it to the
next locker at once, so a SIGKILLed holder blocks nobody. A thread lock
orders the threads of one manager (the mutex belongs to the thread that took
it, and the thread lock makes that the thread that releases it).

NOTE: a holder that dies mid-update leaves half-linked lists behind. Every
holder sets the ``dirty`` counter when it takes the lock and clears it when
it leaves cleanly; whoever next takes the lock and finds it set runs
``on_dirty`` (a full rebuild of the derived state) before going on.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time

from .errors import ShmCacheError
from .layout import C_DIRTY, C_HOLDER, C_LOCK_WAIT_NS, C_OPS

# struct flock on Linux (x86-64 and aarch64): short, short, off_t, off_t, pid_t
_FLOCK = "hhqqi4x"

# Exceptions our operations raise only before they change anything
# (check-then-commit), so the pool stays clean when they escape.
CLEAN_ERRORS = (ValueError, TypeError, KeyError, IndexError, ShmCacheError)


def ofd_lock(fd: int, offset: int) -> bool:
    """Take an OFD write lock on one byte; False if another description holds it."""
    arg = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
        return True
    except (BlockingIOError, PermissionError):
        return False


def ofd_unlock(fd: int, offset: int) -> None:
    arg = struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)


def ofd_held_by_other(fd: int, offset: int) -> bool:
    """True when an open file description other than ``fd``'s holds the byte."""
    arg = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg)
    return struct.unpack(_FLOCK, res)[0] != fcntl.F_UNLCK


class PoolLock:
    """Reentrant inter-process lock over one pool, with a dirty mark.

    ``native`` is the pool's mutex (``mutex.open_hot``), ``counters`` its
    int64 counter memoryview. ``on_dirty`` runs with the lock held when the
    previous holder did not leave cleanly.
    """

    def __init__(self, native, counters, on_dirty) -> None:
        self.native = native
        self.slot = -1              # the pool's slot, recorded as the holder
        self._c = counters
        self._on_dirty = on_dirty
        self._tlock = threading.RLock()
        self._depth = 0
        self._keep_dirty = 0
        self.check_usable = None    # raises once the owner is closed or forked
        self.unusable = False       # set with it, so the hot path tests a flag
        self.wait_log = None        # a list to append each slow-path wait (ns) to

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
            if self.native.trylock() < 0:
                self._wait()
        except BaseException:
            self._tlock.release()
            raise
        self._depth = 1
        c = self._c
        if c[C_DIRTY]:
            self._dirty_on_entry()
        else:
            # (a dirty pool keeps the holder that left it so: repair waits for it)
            c[C_HOLDER] = self.slot
            self._keep_dirty = 0
            c[C_DIRTY] = 1
        return self

    def _wait(self) -> None:
        t0 = time.perf_counter_ns()
        self.native.lock()
        waited = time.perf_counter_ns() - t0
        if self.wait_log is not None:
            self.wait_log.append(waited)
        if waited > self._c[C_LOCK_WAIT_NS]:
            self._c[C_LOCK_WAIT_NS] = waited

    def _dirty_on_entry(self) -> None:
        try:
            # False: nobody could repair yet (a manager still attaching)
            self._keep_dirty = int(self._on_dirty() is False)
        except BaseException:
            # Still dirty: the next holder repairs. Never keep the lock.
            self._depth = 0
            self.native.unlock()
            self._tlock.release()
            raise
        self._c[C_DIRTY] = 1

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
            c = self._c
            c[C_OPS] += 1
            c[C_DIRTY] = self._keep_dirty
        finally:
            self.native.unlock()
            self._tlock.release()
        return False

    @property
    def held(self) -> bool:
        return self._depth > 0

"""Everything shmcache needs from Linux, behind one small interface.

- the segment directory (``SHM_DIR``, a tmpfs), its free space, creating a
  file there with no name yet (O_TMPFILE) and naming it once ready
  (``open_unnamed``, ``link_fd``), and reserving its pages (``reserve``);
- byte locks owned by an open file description (OFD locks), which the
  kernel drops when the holder dies: the liveness bytes and the creation
  lock (``byte_lock``, ``byte_unlock``, ``byte_held_by_other``);
- the robust pthread mutex in the segment's header (``RobustMutex``; the C
  accelerator ``_hot`` drives the same mutex).

``shmcache.system.platform`` picks this module on Linux. A macOS backend would be a
``platform_darwin.py`` beside it with the same names; docs/design.md says
how each would be done there.

NOTE: no wait on the mutex is unbounded: ``lock`` sleeps at most 10 ms at a
time and then looks at the lock word again, because a waiter can otherwise
sleep forever on a free lock (glibc wakes one waiter at unlock; if that one
is SIGKILLed before it runs while a third process took the lock by CAS, or
an unlocker dies between clearing the word and the wake, nobody wakes the
rest). ``lock_slices()`` counts the slices that ran out.

NOTE: the kernel hands a robust mutex to the next locker as soon as its
holder dies (the thread's robust list is walked at exit), so a SIGKILLed
holder blocks nobody, and a reused pid cannot be taken for the holder.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import struct

SHM_DIR = "/dev/shm"


# ------------------------------------------------------------ the segment
def free_bytes(path: str = SHM_DIR) -> int:
    """Bytes free for an unprivileged user in the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def open_unnamed(path: str, tmpfile: bool = True) -> tuple:
    """(fd, named): a new file in ``path``'s directory with no name yet
    (O_TMPFILE), or, where that cannot be had, the file ``path`` itself
    (O_EXCL; FileExistsError if it exists). Mode 0600."""
    flag = getattr(os, "O_TMPFILE", 0) if tmpfile else 0
    if flag:
        try:
            return os.open(os.path.dirname(path), flag | os.O_RDWR, 0o600), False
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), True


def link_fd(fd: int, path: str) -> None:
    """Give the unnamed file ``fd`` the name ``path`` (FileExistsError if
    taken; another OSError where /proc is missing)."""
    # NOTE: linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N links the file
    # itself; os.link calls linkat only when given a directory fd (plain
    # link() would link the /proc symlink: EXDEV).
    d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=d,
                follow_symlinks=True)
    finally:
        os.close(d)


def reserve(fd: int, size: int) -> None:
    """Allocate the file's pages now (OSError when the filesystem is full).

    NOTE: ftruncate alone leaves a sparse file; touching a page past the
    tmpfs limit later kills the process with SIGBUS."""
    os.posix_fallocate(fd, 0, size)


# ------------------------------------------------------------ byte locks
# struct flock on Linux (x86-64 and aarch64): short, short, off_t, off_t, pid_t
_FLOCK = "hhqqi4x"


def byte_lock(fd: int, offset: int) -> bool:
    """Take an OFD write lock on one byte; False if another description holds it."""
    arg = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
        return True
    except (BlockingIOError, PermissionError):
        return False


def byte_unlock(fd: int, offset: int) -> None:
    arg = struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)


def byte_held_by_other(fd: int, offset: int) -> bool:
    """True when an open file description other than ``fd``'s holds the byte."""
    arg = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg)
    return struct.unpack(_FLOCK, res)[0] != fcntl.F_UNLCK


# ------------------------------------------------------------ the mutex
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_CLOCK_MONOTONIC = 1
LOCK_SLICE_S = 0.010     # the longest one futex sleep on the pool lock lasts
DEAD_OWNER_SLICES = 100  # slices naming one owner before asking if it exists


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

_PSHARED, _ROBUST, _ERRORCHECK = 1, 1, 2     # PTHREAD_PROCESS_SHARED, ..._ROBUST, ..._ERRORCHECK


class RobustMutex:
    """A process-shared, robust, error-checking pthread mutex at byte
    ``mutex_off`` of mapping ``mm``, through libc (ctypes releases the GIL
    around each foreign call, so ``lock`` waits without blocking threads).

    ``trylock``/``lock`` return 0 when taken, 1 when taken from a holder
    that died (made consistent, and the int64 at ``dirty_off`` set to 1 so
    the next holder repairs); ``trylock`` returns -1 when busy. This is the
    reference implementation; ``_hot`` drives the same mutex in C.
    """

    def __init__(self, mm, mutex_off: int, dirty_off: int) -> None:
        self._anchor = ctypes.c_char.from_buffer(mm, mutex_off)
        self._m = ctypes.c_void_p(ctypes.addressof(self._anchor))
        self._dirty = ctypes.c_int64.from_buffer(mm, dirty_off)
        self._word = ctypes.c_uint32.from_buffer(mm, mutex_off)    # glibc's lock word

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

    def lock(self, give_up: bool = False) -> int:
        # As _hot's lock_bounded: no futex sleep longer than LOCK_SLICE_S, so
        # a wake-up lost to a killed waiter or unlocker costs one slice.
        # give_up: -2 (not locked) when the word named one live thread for
        # DEAD_OWNER_SLICES (the caller judges it: slots.lock_owner_problem).
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
            RobustMutex.slices += 1
            w = self._word.value
            same = same + 1 if w == last else 0
            last = w
            if same >= DEAD_OWNER_SLICES:      # as _hot's owner_vanished
                self._owner_vanished(w)
                same = 0
                if give_up and self._word.value == w:
                    return -2

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
        self.mark_owner_dead(w)

    def mark_owner_dead(self, w: int) -> bool:
        """Mark the owner of lock word ``w`` dead, as the kernel does at a
        thread's exit, if the word is still ``w``: the next lock attempt
        returns EOWNERDEAD and repairs."""
        if not w & 0x3FFFFFFF or w & 0x40000000:
            return False
        # NOTE: ctypes has no compare-and-swap, so this is a store after a
        # re-read: the named holder is dead (or judged no holder), so only a
        # waiter that takes the lock in the few instructions between could
        # have changed the word. The C accelerator (the normal path) uses a
        # real CAS.
        if self._word.value != w:
            return False
        self._word.value = (w & 0x80000000) | 0x40000000
        return True

    def lock_word(self) -> int:
        return self._word.value

    slices = 0          # timed-lock slices that ran out in this process (a test hook)

    def lock_slices(self) -> int:
        return RobustMutex.slices

    def unlock(self) -> None:
        e = _libc.pthread_mutex_unlock(self._mutex())
        if e:
            raise OSError(e, os.strerror(e))

    def release(self) -> None:
        self._m = None
        self._anchor = self._dirty = self._word = None

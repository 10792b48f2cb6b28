"""Opening, sizing and removing pool segment files in /dev/shm.

We open the files ourselves (``os.open`` + ``mmap``) instead of using
``multiprocessing.shared_memory``: on Python < 3.13 that module registers
every attached segment with the resource tracker, which unlinks it when the
attaching process exits, so a worker that attaches and exits would destroy
the pool (gh-82300).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import time

import numpy as np

from ..errors import (IncompatiblePoolError, InsufficientSharedMemoryError, PoolExistsError,
                     PoolNotFoundError, UnsafePoolError)
from .layout import HEADER_DTYPE, INIT_LOCK_OFF, LAYOUT_VERSION, MAGIC
from ..system.platform import (SHM_DIR, byte_held_by_other, byte_lock, byte_unlock, free_bytes,
                       link_fd, open_unnamed, reserve)

PREFIX = "shmcache."
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.startswith("."):
        raise ValueError(
            f"invalid pool name {name!r}: use 1-200 characters of "
            "letters, digits, '_', '-', '.' (not starting with '.')")
    return name


def path_for(name: str) -> str:
    return os.path.join(SHM_DIR, PREFIX + check_name(name))


def list_names() -> list[str]:
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(PREFIX):] for e in entries if e.startswith(PREFIX))


def _open_unnamed(path: str, tmpfile: bool = True) -> tuple:
    try:
        return open_unnamed(path, tmpfile)
    except FileExistsError:
        raise PoolExistsError(f"pool {path[len(SHM_DIR) + 1 + len(PREFIX):]!r} already exists "
                              f"({path})") from None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # (a file needs an inode: a tmpfs can run out of them with bytes free)
        try:
            st = os.statvfs(SHM_DIR)
            inodes = f"{st.f_favail:,} of {st.f_files:,} inodes free"
        except OSError:
            inodes = "inodes unknown"
        raise InsufficientSharedMemoryError(
            f"pool {path[len(SHM_DIR) + 1 + len(PREFIX):]!r}: cannot create a file in "
            f"{SHM_DIR} ({e.strerror}; {inodes}, {free_bytes(SHM_DIR):,} bytes free)") from None


def create_file(name: str, size: int, header: bytes = b"", private: bool = False) -> int:
    """Create and reserve a segment of ``size`` bytes starting with ``header``;
    return its fd.

    A named segment gets its name only once ``header`` is in it and the
    creator holds the OFD lock on byte ``INIT_LOCK_OFF``, which it keeps
    until :func:`creation_done`: whoever opens the name meanwhile sees a pool
    being created, never an anonymous file (``read_ready_header``). A
    private one never gets a name. (Without O_TMPFILE, or /proc to link
    it, the file is created under its name and locked just after, so an
    attacher may find it empty and unlocked for that moment.)

    Raises:
        PoolExistsError: a segment of that name exists.
        InsufficientSharedMemoryError: /dev/shm cannot hold ``size`` bytes.
    """
    path = path_for(name)
    free = free_bytes(SHM_DIR)
    if size > free:
        raise InsufficientSharedMemoryError(
            f"pool {name!r} needs {size:,} bytes but {SHM_DIR} has only "
            f"{free:,} bytes free")
    if not private and os.path.lexists(path):
        raise PoolExistsError(f"pool {name!r} already exists ({path})")
    fd, named = _open_unnamed(path)
    try:
        if private and named:
            os.unlink(path)     # nobody attaches to a private pool
            named = False
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
        if not private and named and not byte_lock(fd, INIT_LOCK_OFF):
            raise PoolExistsError(f"pool {name!r} is being created by another process")
        if header:
            os.pwrite(fd, header, 0)
        if not private and not named:
            byte_lock(fd, INIT_LOCK_OFF)     # (nobody else can see this file yet)
            try:
                link_fd(fd, path)
            except FileExistsError:
                raise PoolExistsError(f"pool {name!r} already exists ({path})") from None
            except OSError:
                # no /proc to link through: create it under its name instead
                os.close(fd)
                fd = -1
                fd, named = _open_unnamed(path, tmpfile=False)
                byte_lock(fd, INIT_LOCK_OFF)
                os.fchmod(fd, 0o600)
                if header:
                    os.pwrite(fd, header, 0)
            named = True
        try:
            reserve(fd, size)     # (a sparse file would SIGBUS past the tmpfs limit)
        except OSError as e:
            raise InsufficientSharedMemoryError(
                f"pool {name!r} needs {size:,} bytes; reserving them in {SHM_DIR} "
                f"failed ({e.strerror}); {free:,} bytes were free") from None
    except BaseException:
        if named:
            os.unlink(path)
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def creation_done(fd: int) -> None:
    """The header is ready (or creation failed): attachers stop waiting."""
    byte_unlock(fd, INIT_LOCK_OFF)


def being_created(fd: int) -> bool:
    """Whether another process holds the segment's creation lock."""
    return byte_held_by_other(fd, INIT_LOCK_OFF)


def check_safe(fd: int, path: str) -> os.stat_result:
    """Refuse a segment that another user owns or others can write.

    Checked on the open descriptor, not the path, so the file checked is the
    file used. Anyone who can write a segment can make every process mapping
    it misbehave; only this user's 0600 (or read-only) files are pools.

    Raises:
        UnsafePoolError: naming the owner or the mode.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise IncompatiblePoolError(f"{path} is not a shmcache pool (not a regular file)")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafePoolError(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {uid}): refusing "
            "a segment another user could have planted or can change")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                           if st.st_mode & bit)
        raise UnsafePoolError(
            f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): refusing a "
            "segment that other users can change (shmcache makes pools 0600)")
    return st


def open_file(name: str, readonly_ok: bool = False) -> int:
    """Open pool ``name``'s segment (read-write, or read-only when that is all
    we may and ``readonly_ok``) after :func:`check_safe`.

    Raises:
        PoolNotFoundError, UnsafePoolError, IncompatiblePoolError.
    """
    path = path_for(name)
    flags = os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        try:
            fd = os.open(path, os.O_RDWR | flags)
        except PermissionError:
            if not readonly_ok:
                raise
            fd = os.open(path, os.O_RDONLY | flags)
    except FileNotFoundError:
        raise PoolNotFoundError(f"no shmcache pool named {name!r} ({path} does not exist)") from None
    except PermissionError:
        try:
            owner = f"uid {os.lstat(path).st_uid}"
        except OSError:
            owner = "another user"
        raise UnsafePoolError(f"{path}: permission denied (it belongs to {owner})") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePoolError(f"{path} is a symbolic link: refusing it") from None
        raise
    try:
        check_safe(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _header_problem(hdr, size: int, name: str):
    """Why a header found not ready can never become ready (an error), or None."""
    path = path_for(name)
    if hdr is None:
        return IncompatiblePoolError(f"{path} is not a shmcache pool ({size} bytes)")
    if bytes(hdr["magic"]) != MAGIC:
        return IncompatiblePoolError(f"{path} is not a shmcache pool (bad magic)")
    if int(hdr["version"]) != LAYOUT_VERSION:
        return IncompatiblePoolError(
            f"pool {name!r} has layout version {int(hdr['version'])}; "
            f"this shmcache reads version {LAYOUT_VERSION}")
    return None


def read_header(fd: int):
    """(header record or None when the file is shorter than a header, file size)."""
    size = os.fstat(fd).st_size
    if size < HEADER_DTYPE.itemsize:
        return None, size
    raw = os.pread(fd, HEADER_DTYPE.itemsize, 0)
    if len(raw) < HEADER_DTYPE.itemsize:
        return None, size
    return np.frombuffer(raw, HEADER_DTYPE)[0], size


def read_ready_header(fd: int, name: str, timeout: float = 0.0):
    """(ready header, file size) of the segment open at ``fd``.

    While its creator holds the creation lock (``being_created``)
    this waits, up to ``timeout`` seconds; a header that is not ready with
    nobody creating it is an error at once.

    Raises:
        IncompatiblePoolError: not a pool, another layout version, never
            initialised (its creator died or failed), or still being
            created after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        hdr, size = read_header(fd)
        if hdr is not None and int(hdr["ready"]) == 1 and _header_problem(hdr, size, name) is None:
            return hdr, size
        creating = being_created(fd)
        if not creating:
            # The creator marks the header ready before it drops the lock:
            # read once more, after seeing the lock free.
            hdr, size = read_header(fd)
            if hdr is not None and int(hdr["ready"]) == 1:
                err = _header_problem(hdr, size, name)
                if err is None:
                    return hdr, size
                raise err
        err = _header_problem(hdr, size, name)
        if err is not None and (not creating or hdr is not None):
            raise err
        if not creating:
            pid = int(hdr["creator_pid"])
            raise IncompatiblePoolError(
                f"pool {name!r} was never initialised: its creator (pid {pid}) died or "
                f"failed before finishing; 'shmcache cleanup {name}' removes it")
        if time.monotonic() >= deadline:
            raise IncompatiblePoolError(
                f"pool {name!r} is still being created by another process after "
                f"{timeout:g} s (attach with a longer timeout)")
        time.sleep(0.005)


def map_fd(fd: int, size: int | None = None) -> mmap.mmap:
    if size is None:
        size = os.fstat(fd).st_size
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def unlink(name: str) -> bool:
    try:
        os.unlink(path_for(name))
        return True
    except FileNotFoundError:
        return False

"""Opening, sizing and removing pool segment files in /dev/shm.

We open the files ourselves (``os.open`` + ``mmap``) instead of using
``multiprocessing.shared_memory``: on Python < 3.13 that module registers
every attached segment with the resource tracker, which unlinks it when the
attaching process exits, so a worker that attaches and exits would destroy
the pool (gh-82300).
"""

from __future__ import annotations

import mmap
import os
import re

from .errors import InsufficientSharedMemoryError, PoolExistsError, PoolNotFoundError

SHM_DIR = "/dev/shm"
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


def create_file(name: str, size: int) -> int:
    """Create and reserve a segment of ``size`` bytes; return its fd.

    Raises:
        PoolExistsError: a segment of that name exists.
        InsufficientSharedMemoryError: /dev/shm cannot hold ``size`` bytes.
    """
    path = path_for(name)
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise InsufficientSharedMemoryError(
            f"pool {name!r} needs {size:,} bytes but {SHM_DIR} has only "
            f"{free:,} bytes free")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise PoolExistsError(f"pool {name!r} already exists ({path})") from None
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
        # NOTE: ftruncate alone leaves a sparse file; touching a page past the
        # tmpfs limit later kills the process with SIGBUS. Reserve now.
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise InsufficientSharedMemoryError(
            f"pool {name!r} needs {size:,} bytes; reserving them in {SHM_DIR} "
            f"failed ({e.strerror}); {free:,} bytes were free") from None
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def open_file(name: str) -> int:
    path = path_for(name)
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise PoolNotFoundError(f"no shmcache pool named {name!r} ({path} does not exist)") from None


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

"""Exceptions raised by shmcache. Every one names what was wrong."""


class ShmCacheError(Exception):
    """Base class of shmcache's own errors."""


class PoolNotFoundError(ShmCacheError, FileNotFoundError):
    """No pool segment of that name exists."""


class PoolExistsError(ShmCacheError, FileExistsError):
    """A pool segment of that name exists already."""


class IncompatiblePoolError(ShmCacheError):
    """The segment is not a shmcache pool, or was written by another layout version."""


class CorruptPoolError(IncompatiblePoolError):
    """The segment's contents contradict themselves: a header whose sizes and
    offsets do not fit the file, or a shared index, link or list that points
    outside its structure. Found under the lock, the pool is left marked dirty,
    so its next lock holder rebuilds the derived state from the records."""


class UnsafePoolError(ShmCacheError, PermissionError):
    """The segment belongs to another user, or others can write it: whoever
    can write a segment can crash or misdirect every process attached to it."""


class InsufficientSharedMemoryError(ShmCacheError, MemoryError):
    """/dev/shm cannot hold the pool."""


class OutOfBlocksError(ShmCacheError, ValueError):
    """Not enough free blocks (a ValueError, as the seed's ``get_new_blocks`` raises)."""


class CapacityError(ShmCacheError):
    """A fixed-size shared table (slots, tables, reference records) is full."""


class PoolClosedError(ShmCacheError):
    """The manager was closed."""

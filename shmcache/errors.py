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
    so its next lock holder rebuilds the derived state from the reference
    lists."""


class UnsafePoolError(ShmCacheError, PermissionError):
    """The segment belongs to another user, or others can write it: whoever
    can write a segment can crash or misdirect every process attached to it."""


class InsufficientSharedMemoryError(ShmCacheError, MemoryError):
    """/dev/shm cannot hold the pool."""


class OutOfBlocksError(ShmCacheError, ValueError):
    """Not enough free blocks, or room for references (a ValueError, as the
    seed's ``get_new_blocks`` raises)."""


class CapacityError(OutOfBlocksError):
    """A fixed-size shared area is full: attached slots, block tables, or the
    references tables and managers hold (``max_refs``). An
    ``OutOfBlocksError`` (so a ``ValueError``), as running out of anything
    is reported the way the seed reports running out of blocks."""


class PoolClosedError(ShmCacheError):
    """The manager was closed."""

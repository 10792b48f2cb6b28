"""shmcache: a paged KV cache for LLM inference in shared memory.

Several processes attach to one pool by name and allocate, share, fork and
free its KV blocks at once; ``shmcache.paged_cache`` has the API of
``vllm_mlx.paged_cache`` on top of it.
"""

from __future__ import annotations

# First, before any import below loads mlx: an optimized CBLAS for MLX's CPU
# matmuls (shmcache/blas.py imports only the standard library). Never raises.
try:
    from .blas import use_fast_blas as _use_fast_blas
    _use_fast_blas()
except Exception as _e:  # noqa: BLE001 - a BLAS choice must not break import
    import logging as _logging
    _logging.getLogger(__name__).warning("shmcache: fast BLAS setup failed: %r", _e)

from .errors import (CapacityError, CorruptPoolError, IncompatiblePoolError,
                     InsufficientSharedMemoryError, OutOfBlocksError, PoolClosedError,
                     PoolExistsError, PoolNotFoundError, ShmCacheError, UnsafePoolError)
from .paged_cache import PagedCacheManager
from .pool import Pool

__all__ = ["create_pool", "attach", "destroy", "PagedCacheManager", "ShmCacheError",
           "PoolNotFoundError", "PoolExistsError", "IncompatiblePoolError",
           "InsufficientSharedMemoryError", "OutOfBlocksError", "CapacityError",
           "PoolClosedError", "CorruptPoolError", "UnsafePoolError"]


def create_pool(name: str, *, block_size: int = 64, max_blocks: int = 1000,
                enable_caching: bool = True, num_layers: int = 1, num_kv_heads: int = 1,
                head_dim: int = 8, dtype: str = "float16", max_slots: int = 64,
                max_tables: int | None = None, max_refs: int | None = None) -> PagedCacheManager:
    """Create the named pool ``/dev/shm/shmcache.<name>`` (mode 0600) and return its manager.

    ``max_slots`` managers may attach at once, ``max_tables`` block tables
    exist at once (default: ``max_blocks``, from 64 to 4,096) and
    ``max_refs`` block references are held in them and by the managers
    (default: ``layout.default_max_refs``: 2 per block and 256 per table;
    4 bytes each).

    Raises:
        PoolExistsError: the name is taken.
        InsufficientSharedMemoryError: /dev/shm has too little free space.
        TypeError, ValueError: a bad size, dtype or name.
    """
    from . import segment
    segment.check_name(name)
    pool = Pool.create(name, block_size=block_size, max_blocks=max_blocks,
                       enable_caching=enable_caching, num_layers=num_layers,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                       max_slots=max_slots, max_tables=max_tables, max_refs=max_refs)
    return PagedCacheManager(_pool=pool)


def attach(name: str, timeout: float = 5.0) -> PagedCacheManager:
    """A manager over the existing pool ``name``, from any process of the same user.

    A pool still being created is waited for, up to ``timeout`` seconds.

    Raises:
        PoolNotFoundError: no such pool.
        UnsafePoolError: another user owns the segment, or others can write it.
        IncompatiblePoolError: not a shmcache pool, another layout version, or
            never initialised (its creator died); CorruptPoolError (a
            subclass): a header that does not describe the file.
    """
    return PagedCacheManager(_pool=Pool.attach(name, timeout))


def destroy(name: str) -> bool:
    """Unlink the named pool's segment; True if it existed."""
    from . import segment
    return segment.unlink(name)

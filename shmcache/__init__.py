"""shmcache: a paged KV cache for LLM inference in shared memory.

Several processes attach to one pool by name and allocate, share, fork and
free its KV blocks at once; ``shmcache.manager.paged_cache`` has the API of
``vllm_mlx.paged_cache`` on top of it.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Mapping

# First, before any import below loads mlx: an optimized CBLAS for MLX's CPU
# matmuls (shmcache/system/blas.py imports only the standard library). Never raises.
try:
    from .system.blas import use_fast_blas as _use_fast_blas
    _use_fast_blas()
except Exception as _e:  # noqa: BLE001 - a BLAS choice must not break import
    import logging as _logging
    _logging.getLogger(__name__).warning("shmcache: fast BLAS setup failed: %r", _e)

from .errors import (CapacityError, CorruptPoolError, IncompatiblePoolError,
                     InsufficientSharedMemoryError, OutOfBlocksError, PoolClosedError,
                     PoolExistsError, PoolNotFoundError, ShmCacheError, UnsafePoolError)
from .manager.paged_cache import PagedCacheManager
from .pool.pool import Pool

__all__ = ["create_pool", "attach", "destroy", "PagedCacheManager", "ShmCacheError",
           "PoolNotFoundError", "PoolExistsError", "IncompatiblePoolError",
           "InsufficientSharedMemoryError", "OutOfBlocksError", "CapacityError",
           "PoolClosedError", "CorruptPoolError", "UnsafePoolError"]


def create_pool(name: str, *, block_size: int = 64, max_blocks: int = 1000,
                enable_caching: bool = True, num_layers: int = 1, num_kv_heads: int = 1,
                head_dim: int = 8, dtype: str = "float16", max_slots: int = 64,
                max_tables: int | None = None, max_refs: int | None = None,
                l2: str | None = None, l2_model: str | os.PathLike | None = None,
                cluster_secret: str | bytes | None = None,
                l2_options: Mapping[str, Any] | None = None) -> PagedCacheManager:
    """Create the named pool ``/dev/shm/shmcache.<name>`` (mode 0600) and return its manager.

    ``max_slots`` managers may attach at once, ``max_tables`` block tables
    exist at once (default: ``max_blocks``, from 64 to 4,096) and
    ``max_refs`` block references are held in them and by the managers
    (default: ``layout.default_max_refs``: 2 per block and 256 per table;
    4 bytes each).

    Args:
        l2: a Redis URL (``redis://HOST:PORT[/DB]``): Redis becomes this
            manager's L2 tier, ``mgr.l2`` (see :func:`attach`).
        l2_model, cluster_secret, l2_options: as :func:`attach`.
    Raises:
        PoolExistsError: the name is taken.
        InsufficientSharedMemoryError: /dev/shm has too little free space.
        TypeError, ValueError: a bad size, dtype or name; an L2 URL or
            model that is not one (the pool is then removed again).
        RuntimeError: ``l2`` without the redis package.
    """
    from .shm import segment
    segment.check_name(name)
    pool = Pool.create(name, block_size=block_size, max_blocks=max_blocks,
                       enable_caching=enable_caching, num_layers=num_layers,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                       max_slots=max_slots, max_tables=max_tables, max_refs=max_refs)
    mgr = PagedCacheManager(_pool=pool)
    return _with_l2(mgr, pool.seed, l2, l2_model, cluster_secret, l2_options, mgr.destroy)


def attach(name: str, timeout: float = 5.0, *, l2: str | None = None,
           l2_model: str | os.PathLike | None = None, cluster_secret: str | bytes | None = None,
           l2_options: Mapping[str, Any] | None = None) -> PagedCacheManager:
    """A manager over the existing pool ``name``, from any process of the same user.

    A pool still being created is waited for, up to ``timeout`` seconds.

    With ``l2``, Redis is the manager's second tier, ``mgr.l2`` (an
    ``shmcache.l2.L2Tier``; None without): ``shmcache.models.mlx_lm`` loads the next
    blocks of a prompt from it after an L1 miss and queues every block it
    publishes for it (a background thread writes them). Its counters are the
    pool's (``mgr.l2_counters()``, ``shmcache inspect``). Closing the manager
    stops it (after up to 1 s of writing what is queued).

    Args:
        l2: a Redis URL, ``redis://HOST:PORT[/DB]`` (``rediss://`` for TLS).
        l2_model: the model whose K/V the pool holds: its directory (its
            identity is computed: ``shmcache.l2.model_identity``) or an
            identity string. Required with ``l2``: pools of different models
            never share entries.
        cluster_secret: the secret of the pools that share L2 entries; None:
            ``$SHMCACHE_CLUSTER_SECRET``, else this pool's own (its processes
            share their entries, nobody else does).
        l2_options: keyword arguments of ``L2Tier``: ``timeout`` (s, each
            lookup socket operation), ``retry_s``, ``ttl``, ``queue_bytes``,
            ``max_value_bytes``, ``write_timeout``.
    Raises:
        PoolNotFoundError: no such pool.
        UnsafePoolError: another user owns the segment, or others can write it.
        IncompatiblePoolError: not a shmcache pool, another layout version, or
            never initialised (its creator died); CorruptPoolError (a
            subclass): a header that does not describe the file.
        ValueError: a bad L2 URL, or ``l2`` without ``l2_model``.
        RuntimeError: ``l2`` without the redis package.
    """
    pool = Pool.attach(name, timeout)
    mgr = PagedCacheManager(_pool=pool)
    return _with_l2(mgr, pool.seed, l2, l2_model, cluster_secret, l2_options, mgr.close)


def _with_l2(mgr: PagedCacheManager, seed: bytes, url, model, secret, options, undo):
    """Give ``mgr`` its L2 tier (``mgr.l2``; None without ``url``), stopped
    when the manager is closed; on failure ``undo()`` and raise."""
    mgr.l2 = None
    if url is None:
        if model is not None or secret is not None or options:
            undo()
            raise ValueError("l2_model, cluster_secret and l2_options need l2 (a Redis URL)")
        return mgr
    try:
        from . import l2 as L2
        if model is None:
            raise ValueError("l2 needs l2_model (the model's directory or identity): pools of "
                             "different models must never share L2 entries")
        tier = L2.L2Tier(mgr, L2.check_url(url), model_id=L2.resolve_model(model),
                         secret=L2.resolve_secret(secret, seed), **dict(options or {}))
    except BaseException:
        undo()
        raise
    mgr.l2 = tier
    _stop_before_close(mgr, tier)
    return mgr


def _stop_before_close(mgr: PagedCacheManager, tier) -> None:
    """Make ``close`` and ``destroy`` (and so ``with``) stop ``tier`` first:
    its last counters go into the pool while the manager is still open.
    A manager collected without either stops it too (its writer thread
    holds the manager only weakly)."""
    # NOTE: instance attributes over the class's methods, as the manager has
    # no close hook; the closures hold the manager weakly.
    stop = weakref.finalize(mgr, tier.store.close)
    wmgr = weakref.ref(mgr)
    for name in ("close", "destroy"):
        method = getattr(PagedCacheManager, name)

        def closing(_method=method) -> None:
            m = wmgr()
            stop()
            if m is not None:
                _method(m)
        closing.__doc__ = method.__doc__
        setattr(mgr, name, closing)


def destroy(name: str) -> bool:
    """Unlink the named pool's segment; True if it existed."""
    from .shm import segment
    return segment.unlink(name)

"""The block manager: the seed's API over one shared pool.

``paged_cache.PagedCacheManager`` has every public name of
``vllm_mlx.paged_cache`` with its signature, so code written for the seed
runs unchanged. The state behind it is the shared segment: every public
operation takes the pool lock once, checks its inputs, then commits, so it
is atomic across processes, and a bad input raises before anything changes.

The hot operations exist twice: in C (``shmcache._hot``, one short hold of
the lock each) and in Python (``fastpath`` and the owners' methods), the
reference that the differential tests compare against and the fallback
under ``SHMCACHE_PURE=1``. ``kv`` is the K/V arena (block payloads), read
into MLX arrays with exactly one copy; ``views`` are the live views the
seed's containers expose.
"""

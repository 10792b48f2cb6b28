"""pytest plugin for vllm-mlx's own paged-cache tests (tools/seed_suite.py):
``SHMCACHE_SEED_SUITE=pool`` runs them over ``shmcache.manager.paged_cache``, ``seed``
(the default) over vllm-mlx's own module.

Over a pool, ``vllm_mlx.paged_cache`` *is* ``shmcache.manager.paged_cache`` (put in
``sys.modules`` before vllm-mlx imports it), so the tests' own imports
(``from vllm_mlx.paged_cache import PagedCacheManager``) and vllm-mlx's
``BlockAwarePrefixCache`` get the pool's classes; nothing in the tests is
changed. After each test, every manager it made must pass ``check()`` (the
pool's invariants), and is destroyed.
"""

from __future__ import annotations

import os
import sys
import weakref

import pytest

MODE = os.environ.get("SHMCACHE_SEED_SUITE", "seed")
_made: list = []


def pytest_configure(config):
    if MODE not in ("seed", "pool"):
        raise pytest.UsageError(f"SHMCACHE_SEED_SUITE must be 'seed' or 'pool', got {MODE!r}")
    import vllm_mlx
    if MODE == "seed":
        return
    if "vllm_mlx.paged_cache" in sys.modules or "vllm_mlx.prefix_cache" in sys.modules:
        raise pytest.UsageError("vllm_mlx.paged_cache was imported before the plugin could "
                                "put shmcache's in its place")
    from shmcache.manager import paged_cache as pc
    sys.modules["vllm_mlx.paged_cache"] = pc
    vllm_mlx.paged_cache = pc
    from vllm_mlx import prefix_cache
    assert prefix_cache.PagedCacheManager is pc.PagedCacheManager
    init = pc.PagedCacheManager.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _made.append(weakref.ref(self))

    pc.PagedCacheManager.__init__ = recording_init


def pytest_report_header(config):
    if MODE == "pool":
        import shmcache
        return f"seed suite over a shmcache pool (vllm_mlx.paged_cache -> {shmcache.__file__})"
    import vllm_mlx.paged_cache as seed
    return f"seed suite over the seed module ({seed.__file__})"


@pytest.fixture(autouse=True)
def _pool_invariants():
    """Over a pool: each manager the test made passes ``check()``."""
    yield
    made = [r() for r in _made]
    _made.clear()
    problems = []
    for m in made:
        if m is None:
            continue
        problems += m.check()
        m.destroy()
    assert problems == [], problems

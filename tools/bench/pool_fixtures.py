"""What the pool benchmark's items share (:mod:`tools.bench.pool` items 1-3,
:mod:`tools.bench.pool_scale` items 4-5, :mod:`tools.bench.pool_profile`):
the seed module, the pools a run makes, and the timing loops."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import statistics
import sys
import time

import shmcache
from shmcache.shm import segment

PREFIX = f"bench-{os.getpid()}-"
BATCH = 64
# the repository root (the --worker processes run there)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
perf = time.perf_counter


# ---------------------------------------------------------------- the seed
def load_seed():
    """The seed module ``vllm_mlx.paged_cache``, or None if it is not installed."""
    try:
        return importlib.import_module("vllm_mlx.paged_cache")
    except ImportError as e:
        if e.name in ("vllm_mlx", "vllm_mlx.paged_cache"):
            return None
        log(f"importing vllm_mlx.paged_cache failed ({e}); loading the file alone")
    except (RuntimeError, AttributeError, OSError) as e:
        log(f"importing vllm_mlx.paged_cache failed ({e}); loading the file alone")
    spec = importlib.util.find_spec("vllm_mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "paged_cache.py")
    s = importlib.util.spec_from_file_location("_seed_paged_cache", path)
    mod = importlib.util.module_from_spec(s)
    sys.modules[s.name] = mod
    s.loader.exec_module(mod)
    return mod


def seed_batch_free(mgr):
    """(callable freeing a list of blocks, how) for a seed manager."""
    d = type(mgr).__dict__
    for name in ("free_block_batch", "free_blocks"):
        f = d.get(name)
        if callable(f) and not isinstance(f, property):
            return getattr(mgr, name), f"seed {name}(blocks)"
    free = mgr.free_block

    def loop(blocks):
        for b in blocks:
            free(b.block_id)
    return loop, "seed free_block per block (no batch free reachable)"


# ----------------------------------------------------------------- helpers
class Pools:
    """Named pools made by this benchmark; ``close`` detaches and destroys them all."""

    def __init__(self) -> None:
        self.creators, self.attached, self._n = [], [], 0

    def create(self, tag: str, **kw):
        """(name, attached manager) of a new pool."""
        self._n += 1
        name = f"{PREFIX}{tag}-{self._n}"
        self.creators.append(shmcache.create_pool(name, **kw))
        m = shmcache.attach(name)
        self.attached.append(m)
        return name, m

    def close(self) -> None:
        for m in self.attached:
            try:
                m.close()
            except (shmcache.ShmCacheError, OSError) as e:
                log(f"closing {m.name}: {e}")
        for c in self.creators:
            try:
                c.destroy()
            except (shmcache.ShmCacheError, OSError) as e:
                log(f"destroying {c.name}: {e}")
        self.attached, self.creators = [], []
        cleanup_segments()


def cleanup_segments() -> list:
    left = [n for n in segment.list_names() if n.startswith(PREFIX)]
    for n in left:
        segment.unlink(n)
    return left


def calibrate(fn, target_s: float) -> int:
    """Iterations of ``fn(n) -> seconds`` for one trial of about ``target_s``."""
    n = 8
    while True:
        t = fn(n)
        if t >= 0.02 or n >= 1 << 24:
            return max(1, int(n * target_s / max(t, 1e-9)))
        n *= 4


def interleaved(fns: dict, trials: int, target_s: float, per: int = 1) -> dict:
    """Median seconds per unit of each ``fns[k](n) -> seconds`` (n iterations of
    ``per`` units), trials alternating between the implementations."""
    ns = {k: calibrate(f, target_s) for k, f in fns.items()}
    res = {k: [] for k in fns}
    keys = list(fns)
    for i in range(trials):
        for k in (keys if i % 2 == 0 else keys[::-1]):
            gc.collect()
            res[k].append(fns[k](ns[k]) / (ns[k] * per))
    return {k: statistics.median(v) for k, v in res.items()}


def pair_loop(m):
    alloc, free = m.allocate_block, m.free_block

    def fn(n):
        t = perf()
        for _ in range(n):
            b = alloc()
            free(b.block_id)
        return perf() - t
    return fn


def batch_loop(m, free_batch):
    get = m.get_new_blocks

    def fn(n):
        t = perf()
        for _ in range(n):
            free_batch(get(BATCH))
        return perf() - t
    return fn


def log(msg: str) -> None:
    print(f"[bench pool] {msg}", file=sys.stderr, flush=True)

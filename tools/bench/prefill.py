"""Prefill time against prompt length, and a worker's memory against batch rows.

    python -m tools.bench.prefill lengths [1024 2048 4096 8192]
    python -m tools.bench.prefill rows T N      # one request of N samples over T tokens

``lengths``: the engine (``workers.worker.engine.Engine`` over a fresh
pool, ``--prefill-step`` 512) against mlx-lm's own ``KVCache`` fed the same
512-token chunks, on the demo model (``shmcache.models.demo_model``), each a
single run; then the time of each 512-token chunk by its position.
``rows``: the process's RSS growth, the engine's ``working_bytes()`` peak
and the context's K/V size while one request's N samples decode.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

import shmcache  # first: binds the fast BLAS before mlx loads

STEP = 512


def _model():
    from mlx_lm import load

    from shmcache.models.demo_model import build_model_dir
    from shmcache.models.mlx_lm import pool_layout
    path = build_model_dir(os.path.join(tempfile.gettempdir(), "shmcache-bench-prefill"), "llama")
    model, _ = load(str(path))
    return model, pool_layout(model)


def _prompt(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def _engine(model, lay, prompt, n=1, max_tokens=1, temperature=0.0, watch=None):
    from workers.worker.engine import Engine
    from workers.protocol import SamplingParams
    from workers.wire import Gen
    name = f"bench-prefill-{os.getpid()}"
    mgr = shmcache.create_pool(name, block_size=16, max_blocks=len(prompt) // 16 * 2 + 64 * n,
                               **lay)
    try:
        ev: list = []
        e = Engine(mgr, model, [], lambda k, p: ev.append(k), prefill_step=STEP)
        e.submit(Gen(1, prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                               n=n), 1))
        t0 = time.perf_counter()
        while e.busy:
            e.step()
            if watch:
                watch(e)
            if max_tokens == 1 and "admitted" in ev:
                break
        dt = time.perf_counter() - t0
        e.close()
        return dt, e
    finally:
        mgr.destroy()


def lengths(argv) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    model, lay = _model()
    sizes = [int(a) for a in argv] or [1024, 2048, 4096, 8192]

    def plain(p):
        caches = [KVCache() for _ in model.layers]
        t0, per = time.perf_counter(), []
        for i in range(0, len(p), STEP):
            t = time.perf_counter()
            out = model(mx.array(p[i:i + STEP])[None], cache=caches)
            mx.eval(out, [c.keys for c in caches])
            per.append(time.perf_counter() - t)
        return time.perf_counter() - t0, per

    plain(_prompt(STEP, 0))
    _engine(model, lay, _prompt(STEP, 1))
    for n in sizes:
        a, per = plain(_prompt(n, n))
        b, _ = _engine(model, lay, _prompt(n, n + 1))
        print(f"{n:6d} tokens: mlx-lm KVCache {a:7.2f} s   engine over the pool {b:7.2f} s   "
              f"({b / n * 1e3:.2f} ms/token)", flush=True)
    print("512-token chunks of the last (mlx-lm KVCache), by position: " +
          ", ".join(f"{i * STEP}: {t:.2f} s" for i, t in enumerate(per)))


def rows(argv) -> None:
    import mlx.core as mx
    import psutil
    T, n = int(argv[0]), int(argv[1])
    model, lay = _model()
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = {"rss": 0, "wb": 0}

    def watch(e):
        peak["rss"] = max(peak["rss"], proc.memory_info().rss)
        peak["wb"] = max(peak["wb"], e.working_bytes())
    _, e = _engine(model, lay, _prompt(T, T), n=n, max_tokens=8, temperature=0.7, watch=watch)
    mib = 2 ** 20
    print(f"T={T} rows={n}: RSS +{(peak['rss'] - base) / mib:.1f} MiB, working_bytes() peak "
          f"{peak['wb'] / mib:.1f} MiB, the context's K/V {T * e.token_bytes / mib:.1f} MiB, "
          f"MLX peak {mx.get_peak_memory() / mib:.1f} MiB")


if __name__ == "__main__":
    cmd, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("lengths", [])
    {"lengths": lengths, "rows": rows}[cmd](rest)

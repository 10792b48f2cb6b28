"""Where an engine step's time goes (a diagnosis aid, off by default).

With ``SHMCACHE_STEP_TIMING=DIR`` in a worker's environment, its
:class:`~workers.worker.engine.Engine` appends one line per step to
``DIR/engine-<pid>.log``: the wall time, the gap since the previous step
(the worker loop and the supervisor's messages), the rows before and after,
and for each engine method called in the step ``name=calls:milliseconds``
(inclusive: ``_admit`` contains ``_prefill_chunk``, which contains
``_forward_chunk``). Unset, nothing is wrapped and nothing is written.

    SHMCACHE_STEP_TIMING=/tmp/t python -m tools.bench.serve --only a ...
"""
import functools
import os
import time

_DIR = os.environ.get("SHMCACHE_STEP_TIMING")
NAMES = ("_admit", "_start", "_finish_start", "_prefill_group", "_prefill_chunk",
         "_forward_chunk", "_to_rows", "_extend_batch", "_decode", "_advance", "_sample")


def install(eng):
    """Wrap ``eng``'s methods in NAMES with timers and open its log (when enabled)."""
    if not _DIR:
        return
    eng._tacc = {}
    eng._tfile = open(os.path.join(_DIR, f"engine-{os.getpid()}.log"), "a", buffering=1)
    eng._tlast = None
    for n in NAMES:
        f = getattr(eng, n)

        def wrap(f=f, n=n):
            @functools.wraps(f)
            def g(*a, **k):
                t = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    d = time.perf_counter() - t
                    c = eng._tacc.setdefault(n, [0, 0.0])
                    c[0] += 1
                    c[1] += d
            return g
        setattr(eng, n, wrap())


def begin(eng):
    """A step starts."""
    if not _DIR or getattr(eng, "_tfile", None) is None:
        return
    eng._tstart = time.perf_counter()
    eng._trows0 = len(eng.rows)


def end(eng):
    """A step ended: write its line."""
    if not _DIR or getattr(eng, "_tfile", None) is None:
        return
    t = time.perf_counter()
    gap = (eng._tstart - eng._tlast) if eng._tlast else 0.0
    eng._tlast = t
    parts = " ".join(f"{n}={c[0]}:{c[1]*1000:.1f}" for n, c in eng._tacc.items())
    eng._tfile.write(f"{time.time():.3f} total={(t-eng._tstart)*1000:.1f} gap={gap*1000:.1f} "
                     f"rows={eng._trows0}->{len(eng.rows)} {parts}\n")
    eng._tacc.clear()


def close(eng):
    """The engine closes: close its log."""
    f = getattr(eng, "_tfile", None)
    if f is not None:
        f.close()
        eng._tfile = None

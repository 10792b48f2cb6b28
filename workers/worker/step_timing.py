"""Where an engine step's time goes (a diagnosis aid, off by default).

With ``SHMCACHE_STEP_TIMING=DIR`` in a worker's environment, its
:class:`~workers.worker.engine.Engine` appends one line per step to
``DIR/engine-<pid>.log``: the wall time, the gap since the previous step
(the worker loop and the supervisor's messages), the rows before and after,
the BLAS threads, and for each engine method called in the step
``name=calls:milliseconds`` (inclusive: ``_admit`` contains
``_prefill_chunk``, which contains ``_forward_chunk``). Unset, nothing is
wrapped and nothing is written.

    SHMCACHE_STEP_TIMING=/tmp/t python -m tools.bench.serve --only a ...
"""
import functools
import os
import time
import weakref

import shmcache.system.blas as blas

_DIR = os.environ.get("SHMCACHE_STEP_TIMING")
NAMES = ("_admit", "_start", "_finish_start", "_prefill_group", "_prefill_chunk",
         "_forward_chunk", "_to_rows", "_extend_batch", "_decode", "_advance", "_sample")


class _StepLog:
    """One engine's timers and log (the state this module keeps per engine)."""

    def __init__(self, path: str) -> None:
        self.acc: dict = {}             # method name -> [calls, seconds] this step
        self.file = open(path, "a", buffering=1)
        self.last = None                # when the previous step ended
        self.start = 0.0
        self.rows0 = 0


_LOGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # engine -> its _StepLog


def install(eng):
    """Wrap ``eng``'s methods in NAMES with timers and open its log (when enabled)."""
    if not _DIR:
        return
    log = _LOGS[eng] = _StepLog(os.path.join(_DIR, f"engine-{os.getpid()}.log"))
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
                    c = log.acc.setdefault(n, [0, 0.0])
                    c[0] += 1
                    c[1] += d
            return g
        setattr(eng, n, wrap())


def begin(eng):
    """A step starts."""
    log = _LOGS.get(eng) if _DIR else None
    if log is None:
        return
    log.start = time.perf_counter()
    log.rows0 = len(eng.rows)


def end(eng):
    """A step ended: write its line."""
    log = _LOGS.get(eng) if _DIR else None
    if log is None:
        return
    t = time.perf_counter()
    gap = (log.start - log.last) if log.last else 0.0
    log.last = t
    parts = " ".join(f"{n}={c[0]}:{c[1]*1000:.1f}" for n, c in log.acc.items())
    log.file.write(f"{time.time():.3f} total={(t-log.start)*1000:.1f} gap={gap*1000:.1f} "
                   f"rows={log.rows0}->{len(eng.rows)} threads={blas.threads() or 0} {parts}\n")
    log.acc.clear()


def close(eng):
    """The engine closes: close its log."""
    log = _LOGS.pop(eng, None)
    if log is not None:
        log.file.close()

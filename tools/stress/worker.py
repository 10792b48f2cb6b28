"""The per-process side of ``python -m tools.stress``: one stress worker.

Each worker process (started by the runner in :mod:`tools.stress` as
``python -m tools.stress --worker NAME ...``) attaches to the pool by name
and runs the random workload of :mod:`tools.stress.workload_driver` (bounded by
its demand, every payload it reads checked) until SIGTERM or until its
parent dies, then releases everything and detaches. It reports progress,
peak RSS/PSS, its waits for the pool lock and any mismatch, violation or
error through its result file, rewritten atomically a few times a second
so that a killed worker's figures up to its death are kept.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import psutil

from tools.stress.workload_driver import Workload

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16      # the stress pool's shape
EXIT_ATTACH_FULL = 3


def _to_mx(a):
    import mlx.core as mx       # the engine's array type: writes go through its path
    return mx.array(a)


class Worker(Workload):
    """The workload of one stress process, reporting through a result file.

    Args:
        args: the parsed ``--worker`` flags (worker: the pool name, seed,
            result, parent, demand, prompt_seed).
    """

    def __init__(self, args) -> None:
        import shmcache
        from shmcache import CapacityError
        try:
            m = shmcache.attach(args.worker)
        except CapacityError:
            sys.exit(EXIT_ATTACH_FULL)
        if getattr(args, "reserve", 0):      # (tests build args without it)
            m.set_reserve(args.reserve)
        super().__init__(m, args.seed, args.demand, prompt_seed=args.prompt_seed,
                         convert=_to_mx)
        self.result_path = args.result
        self.parent = args.parent
        self.stop = False
        self.waits = m.pool.lock.wait_log = []     # waits for the pool lock, ns
        self.waits_dropped = 0
        self.r.update(pid=self.pid, peak_rss_bytes=0, peak_pss_bytes=0, done=False, error=None)
        self.proc = psutil.Process()
        self.last_flush = 0.0

    def on_problem(self) -> None:
        self.flush(force=True)          # kept even if we are killed next

    def flush(self, force=False) -> None:
        now = time.monotonic()
        if not force and now - self.last_flush < 0.25:
            return
        self.last_flush = now
        try:
            mi = self.proc.memory_full_info()
            self.r["peak_rss_bytes"] = max(self.r["peak_rss_bytes"], mi.rss)
            self.r["peak_pss_bytes"] = max(self.r["peak_pss_bytes"], getattr(mi, "pss", 0))
        except psutil.Error:
            pass
        # the count of waits and the slowest 1,024 are enough for a p99 of
        # up to ~100k waits per process
        if len(self.waits) > 2048:
            self.waits.sort()
            self.waits_dropped += len(self.waits) - 1024
            del self.waits[:-1024]
        self.r["lock_waits"] = self.waits_dropped + len(self.waits)
        self.r["lock_waits_top_ns"] = sorted(self.waits)[-1024:]
        tmp = self.result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.r, f)
        os.replace(tmp, self.result_path)
        if os.getppid() != self.parent:
            self.stop = True           # orphaned: the parent died

    def run(self) -> None:
        while not self.stop:
            self.step()
            self.flush()
        self.release()

    def release(self) -> None:
        """Release everything, detach, and write the final result."""
        super().release()
        self.m.close()
        self.r["done"] = True
        self.flush(force=True)


def worker_main(args) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent handles Ctrl-C
    import logging   # allocation failures are expected here, and counted
    logging.getLogger("shmcache.manager.paged_cache").addFilter(
        lambda rec: "Out of cache blocks" not in rec.getMessage())
    w = None
    try:
        w = Worker(args)
        signal.signal(signal.SIGTERM, lambda *a: setattr(w, "stop", True))
        w.run()
        return 0
    except SystemExit:
        raise
    except BaseException:
        if w is not None:
            w.r["error"] = traceback.format_exc()[-2000:]
            w.flush(force=True)
        else:
            traceback.print_exc()
        return 1

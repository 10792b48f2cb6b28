"""The supervisor: creates the pool, runs the workers, feeds them work.

``python -m workers.supervisor`` (what ``make run`` calls) creates a named
pool sized from the flags, starts ``--workers`` worker processes with
``multiprocess`` (spawned, so none inherits the pool's descriptors), sends
them the built-in workload over msgspec-encoded pipes, shows progress,
restarts a worker that dies (reclaiming everything it held and handing its
unfinished requests to the others), and prints a final report. The pool is
destroyed on exit, on Ctrl-C and after any crash.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from collections import deque

import multiprocess as mp
import numpy as np
import psutil
from multiprocess.connection import wait as wait_conns

import shmcache
from shmcache import layout as L
from shmcache import segment

from . import workload
from .model import ModelConfig
from .protocol import Channel, Done, Failed, FromWorker, Ready, Shutdown
from .worker import worker_main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m workers.supervisor", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--requests", type=int, default=24, help="requests in the workload")
    ap.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    ap.add_argument("--no-prefix-cache", action="store_true", help="same workload, prefix caching off")
    ap.add_argument("--kill-worker-every", type=float, default=0.0, metavar="SECONDS",
                    help="SIGKILL a random busy worker at this interval (fault injection)")
    ap.add_argument("--max-blocks", type=int, default=0, help="pool size in blocks (default: all requests at once)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--json", metavar="PATH", help="write the report as JSON")
    ap.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--layers", type=int, default=4, help="model layers")
    ap.add_argument("--dim", type=int, default=256, help="model width")
    ap.add_argument("--max-running", type=int, default=3, help="requests a worker interleaves")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)
    for k in ("workers", "requests", "block_size", "layers", "dim", "max_new_tokens", "max_running"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    return a


class SupervisorError(Exception):
    """The run cannot go on (its pool vanished, workers cannot start)."""


class _WorkerProc:
    def __init__(self, ctx, wid: int, pool: str, cfg: dict, max_running: int):
        self.id = wid
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(wid, pool, child, cfg, max_running),
                                daemon=True, name=f"shmcache-worker-{wid}")
        self.proc.start()
        child.close()
        self.chan = Channel(parent, FromWorker)
        self.inflight: dict = {}
        self.ready = False

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


def _percentiles(xs) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "max": None, "n": 0}
    a = np.asarray(xs)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "max": float(a.max()), "n": int(a.size)}


class Supervisor:
    def __init__(self, args) -> None:
        self.a = args
        self.cfg = ModelConfig(num_layers=args.layers, dim=args.dim, num_heads=8, num_kv_heads=4)
        self.reqs = workload.build(args.requests, args.seed, self.cfg.vocab_size,
                                   args.system_tokens, args.max_new_tokens)
        self.by_id = {r.id: r for r in self.reqs}
        self.results: dict = {}
        self.failures: dict = {}
        self.restarts = 0
        self.early_deaths = 0
        self.kills = 0
        self.peak_blocks = 0
        self.peak_table_blocks = 0
        self.name = f"run-{os.getpid()}"
        self.ctx = mp.get_context("spawn")
        self.workers: list = []
        self.mgr = None

    # ------------------------------------------------------------------ setup
    def _pool_blocks(self) -> int:
        if self.a.max_blocks:
            return self.a.max_blocks
        return 1 + sum(workload.blocks_needed(r, self.a.block_size) for r in self.reqs)

    def create_pool(self) -> None:
        c, bs = self.cfg, self.a.block_size
        blocks = self._pool_blocks()
        need = L.compute_layout(bs, blocks, True, c.num_layers, c.num_kv_heads, c.head_dim,
                                "float32", 64, min(max(64, blocks), 4096), 2 * blocks + 256).total_size
        avail = psutil.virtual_memory().available
        if need > avail:
            raise SystemExit(f"a pool of {blocks} blocks needs {need:,} bytes; only {avail:,} "
                             "bytes of memory are available (lower --max-blocks)")
        biggest = max(workload.blocks_needed(r, bs) for r in self.reqs)
        if blocks - 1 < biggest:
            raise SystemExit(f"--max-blocks {blocks} cannot hold the largest request "
                             f"({biggest} blocks + the null block)")
        self.mgr = shmcache.create_pool(
            self.name, block_size=bs, max_blocks=blocks, enable_caching=not self.a.no_prefix_cache,
            num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            dtype="float32")

    def _start_worker(self, wid: int) -> _WorkerProc:
        cfg = {k: getattr(self.cfg, k) for k in self.cfg.__dataclass_fields__}
        return _WorkerProc(self.ctx, wid, self.name, cfg, self.a.max_running)

    # ------------------------------------------------------------------ loop
    def _dispatch(self, queue: deque) -> None:
        cap = self.a.max_running + 1
        for w in sorted(self.workers, key=lambda w: len(w.inflight)):
            while queue and w.ready and len(w.inflight) < cap:
                req = queue.popleft()
                w.inflight[req.id] = req
                w.chan.send(req)

    def _handle(self, w: _WorkerProc, msg) -> None:
        if isinstance(msg, Ready):
            w.ready = True
        elif isinstance(msg, Done):
            w.inflight.pop(msg.id, None)
            self.results[msg.id] = msg
        elif isinstance(msg, Failed):
            w.inflight.pop(msg.id, None)
            self.failures[msg.id] = msg.error

    def _restart_dead(self, queue: deque) -> None:
        for i, w in enumerate(self.workers):
            if w.proc.is_alive():
                continue
            w.proc.join(1)
            if not os.path.exists(segment.path_for(self.name)):
                raise SupervisorError(f"the pool {self.name!r} was removed from under the supervisor")
            self.early_deaths = 0 if w.ready else self.early_deaths + 1
            if self.early_deaths >= 3:
                raise SupervisorError(f"workers died before they were ready 3 times in a row "
                                      f"(last exit code {w.proc.exitcode}); giving up")
            self.mgr.reclaim_dead()
            for rid in sorted(w.inflight, reverse=True):
                if rid not in self.results:
                    queue.appendleft(w.inflight[rid])
            self.workers[i] = self._start_worker(w.id)
            self.restarts += 1

    def _sample_usage(self) -> None:
        p = self.mgr._p
        self.peak_blocks = max(self.peak_blocks, self.mgr.max_blocks - self.mgr.free_blocks - 1)
        live = p.tables["state"] == 1
        self.peak_table_blocks = max(self.peak_table_blocks, int(p.tables["length"][live].sum()))

    def _progress(self, t0: float, final: bool = False) -> None:
        if self.a.quiet:
            return
        done, total = len(self.results) + len(self.failures), len(self.reqs)
        busy = sum(len(w.inflight) for w in self.workers)
        s = self.mgr.get_stats()
        asked = s.cache_hits + s.cache_misses
        bar = "#" * int(20 * done / total) + "." * (20 - int(20 * done / total))
        line = (f"[{bar}] {done}/{total} done, {busy} in flight | pool {self.mgr.usage:5.1%} used, "
                f"hit rate {s.cache_hits / asked if asked else 0:4.0%} | restarts {self.restarts} "
                f"| {time.perf_counter() - t0:5.1f}s")
        if sys.stderr.isatty():
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def run(self) -> dict:
        self.create_pool()
        self.workers = [self._start_worker(i) for i in range(self.a.workers)]
        queue = deque(self.reqs)
        t0 = time.perf_counter()
        last_kill = last_progress = time.perf_counter()
        dispatching = False
        while len(self.results) + len(self.failures) < len(self.reqs):
            # Hold the work until every worker is up (a worker that is still
            # importing MLX would otherwise see none of it), or 60 s passed.
            if all(w.ready for w in self.workers) or time.perf_counter() - t0 > 60:
                if not dispatching:
                    dispatching = True
                    last_kill = time.perf_counter()   # the kill clock starts with the work
                self._dispatch(queue)
            conns = {w.chan.conn: w for w in self.workers}
            for conn in wait_conns(list(conns), timeout=0.1):
                w = conns[conn]
                try:
                    while w.chan.poll():
                        self._handle(w, w.chan.recv())
                except (EOFError, OSError):
                    pass  # it died; _restart_dead takes over
            self._restart_dead(queue)
            self._sample_usage()
            now = time.perf_counter()
            if dispatching and self.a.kill_worker_every and now - last_kill >= self.a.kill_worker_every:
                busy = [w for w in self.workers if w.inflight and w.proc.is_alive()]
                if busy:
                    os.kill(random.choice(busy).proc.pid, signal.SIGKILL)
                    self.kills += 1
                last_kill = now
            if now - last_progress >= (0.5 if sys.stderr.isatty() else 3.0):
                self._progress(t0)
                last_progress = now
        wall = time.perf_counter() - t0
        self._progress(t0, final=True)
        self.stop_workers()
        return self.report(wall)

    def stop_workers(self) -> None:
        for w in self.workers:
            try:
                w.chan.send(Shutdown())
            except (OSError, ValueError):
                pass
        for w in self.workers:
            w.proc.join(10)
            w.kill()

    # ---------------------------------------------------------------- report
    def report(self, wall: float) -> dict:
        m = self.mgr
        m.reclaim_dead()
        s = m.get_stats()
        block_bytes = m.layout.arena_size // m.max_blocks
        reqs = []
        for rid in sorted(self.results):
            d = self.results[rid]
            reqs.append({"id": rid, "worker": d.worker, "prompt_tokens": d.prompt_tokens,
                         "cached_tokens": d.cached_tokens, "outputs": d.outputs, "ttft_s": d.ttft_s,
                         "preemptions": d.preemptions, "n": len(d.outputs),
                         "tenant": self.by_id[rid].salt or "default"})
        prompt = sum(r["prompt_tokens"] for r in reqs)
        gen = sum(len(o) for r in reqs for o in r["outputs"])
        return {
            "requests": reqs,
            "failed": {str(k): v for k, v in self.failures.items()},
            "workers": self.a.workers,
            "prefix_cache": not self.a.no_prefix_cache,
            "prefix_hit_rate": (sum(r["cached_tokens"] for r in reqs) / prompt) if prompt else 0.0,
            "leaked_blocks": s.allocated_blocks - 1,
            "check_violations": len(m.check()),
            "worker_restarts": self.restarts,
            "worker_kills": self.kills,
            "preemptions": sum(r["preemptions"] for r in reqs),
            "cow_copies": s.cow_copies,
            "evictions": s.evictions,
            "max_blocks": m.max_blocks,
            "kv_bytes_per_block": block_bytes,
            "kv_bytes_in_pool": self.peak_blocks * block_bytes,
            "kv_bytes_without_sharing": self.peak_table_blocks * block_bytes,
            "wall_s": wall,
            "generated_tokens": gen,
            "throughput_tokens_per_s": gen / wall if wall else 0.0,
            "throughput_requests_per_s": len(reqs) / wall if wall else 0.0,
            "ttft_cached_s": _percentiles([r["ttft_s"] for r in reqs if r["cached_tokens"]]),
            "ttft_uncached_s": _percentiles([r["ttft_s"] for r in reqs if not r["cached_tokens"]]),
        }

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        if self.mgr is not None:
            self.mgr.destroy()


def print_report(r: dict) -> None:
    mb = 1 << 20
    print(f"requests: {len(r['requests'])} done, {len(r['failed'])} failed, "
          f"{r['generated_tokens']} tokens in {r['wall_s']:.1f}s "
          f"({r['throughput_tokens_per_s']:.1f} tok/s) on {r['workers']} workers")
    print(f"prefix cache: {'on' if r['prefix_cache'] else 'off'}, hit rate {r['prefix_hit_rate']:.1%}; "
          f"cow copies {r['cow_copies']}, evictions {r['evictions']}, preemptions {r['preemptions']}")
    print(f"kv memory at peak: {r['kv_bytes_in_pool'] / mb:.1f} MiB in the shared pool vs "
          f"{r['kv_bytes_without_sharing'] / mb:.1f} MiB without sharing")
    for k in ("ttft_cached_s", "ttft_uncached_s"):
        t = r[k]
        if t["n"]:
            print(f"{k[:-2].replace('_', ' ')}: p50 {t['p50'] * 1e3:.0f} ms, p90 {t['p90'] * 1e3:.0f} ms (n={t['n']})")
    print(f"worker restarts {r['worker_restarts']} (kills {r['worker_kills']}); leaked blocks "
          f"{r['leaked_blocks']}; check violations {r['check_violations']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sup = Supervisor(args)
    try:
        report = sup.run()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping workers and removing the pool", file=sys.stderr)
        return 130
    except SupervisorError as e:
        print(f"\nshmcache supervisor: {e}", file=sys.stderr)
        return 2
    finally:
        sup.close()
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = report["leaked_blocks"] or report["check_violations"] or report["failed"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

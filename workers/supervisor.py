"""Drive ``shmcache serve`` with the built-in workload and report on the run.

``python -m workers.supervisor`` (what ``make run`` calls) starts ``shmcache
serve`` (by default with the demo model) on a free port, sends it the
built-in workload (``workers/workload.py``) with the official ``openai``
client from a few threads at once, so that the server batches them, shows
progress, optionally SIGKILLs worker processes of the server, prints a report
and stops the server (SIGTERM), checking that it left nothing in /dev/shm.

Definitions (the same in the progress line, the report and the README):

* hit rate = cached prompt tokens / prompt tokens, over the requests
  finished, as the server reports them in
  ``usage.prompt_tokens_details.cached_tokens`` and ``usage.prompt_tokens``;
* TTFT = from sending a request to receiving its first token chunk, timed by
  the client (streaming); "cached" requests are those with cached tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import numpy as np
import psutil

from . import workload

SETTLE_S = 5.0            # how long the workers get to release a finished request's blocks
STOP_TIMEOUT_S = 40.0     # the server's graceful stop (5 s) plus its workers' (10 s), with room
WORKER_MODULE = "shmcache.server.worker"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m workers.supervisor", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="server worker processes (default 2)")
    ap.add_argument("--requests", type=int, default=24, help="requests in the workload (default 24)")
    ap.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="same workload with nothing shared between requests: every request "
                         "gets its own cache_salt (the server's cache stays on; the samples of "
                         "one n > 1 request still share their prompt's blocks)")
    ap.add_argument("--kill-worker-every", type=float, default=0.0, metavar="SECONDS",
                    help="SIGKILL a random worker process of the server at this interval, "
                         "while requests are outstanding and every worker is up (fault "
                         "injection; every request must still complete)")
    ap.add_argument("--max-blocks", type=int, default=0,
                    help="pool size in blocks (default: every request at once, unshared)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument("--json", metavar="PATH", help="write the report as JSON")
    ap.add_argument("--model", metavar="PATH",
                    help="an mlx-lm model directory (default: the demo model, built once under "
                         "~/.cache/shmcache); outputs are token ids read back from the text with "
                         "its tokenizer, exact for a byte-level one such as the demo model's")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="requests in flight at once (default: 4 per worker)")
    ap.add_argument("--system-tokens", type=int, default=1000,
                    help="length of the shared system prompt (default 1000)")
    ap.add_argument("--max-new-tokens", type=int, default=24,
                    help="tokens generated per sample (default 24)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="how long the server may take to start (default 300)")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)
    for k in ("workers", "requests", "block_size", "max_new_tokens", "system_tokens"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    for k in ("max_blocks", "concurrency"):
        if getattr(a, k) < 0:
            ap.error(f"--{k.replace('_', '-')} must be >= 0")
    if a.kill_worker_every < 0:
        ap.error("--kill-worker-every must be >= 0")
    if a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
        ap.error(f"--model {a.model}: not an mlx-lm model directory (no config.json)")
    a.concurrency = a.concurrency or 4 * a.workers
    if a.max_blocks:
        reqs = workload.build(a.requests, a.seed, a.system_tokens, a.max_new_tokens)
        biggest = max(workload.blocks_needed(r, a.block_size) for r in reqs)
        if a.max_blocks - 1 < biggest:
            ap.error(f"--max-blocks {a.max_blocks} cannot hold the largest request "
                     f"({biggest} blocks + the null block)")
    return a


class SupervisorError(Exception):
    """The run cannot go on (the server did not start, or died)."""


def _percentiles(xs) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "max": None, "n": 0}
    a = np.asarray(xs)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "max": float(a.max()), "n": int(a.size)}


def _shmcache_command() -> list:
    exe = os.path.join(os.path.dirname(sys.executable), "shmcache")
    if os.access(exe, os.X_OK):
        return [exe]
    return [sys.executable, "-c", "import sys; from shmcache.cli import main; sys.exit(main())"]


def _die_with_parent() -> None:
    # The server gets SIGTERM if this process dies without stopping it.
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:
        pass


class Server:
    """``shmcache serve`` as a subprocess: start, scrape, kill workers, stop."""

    URL_RE = re.compile(r" on (http://\S+) ")
    POOL_RE = re.compile(r"\(pool (\S+): ")

    def __init__(self, a) -> None:
        self.a = a
        self.proc = None
        self.url = self.pool = None
        self.log: deque = deque(maxlen=400)
        self._started = threading.Event()
        self.worker_pids: set = set()
        self._http = None

    def start(self, max_blocks: int) -> None:
        cmd = _shmcache_command() + [
            "serve", "--host", "127.0.0.1", "--port", "0", "--workers", str(self.a.workers),
            "--max-blocks", str(max_blocks), "--block-size", str(self.a.block_size),
            "--log-level", "info"]
        if self.a.model:
            cmd += ["--model", self.a.model]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace",
                                     start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._read_log, daemon=True, name="server-log").start()
        deadline = time.monotonic() + self.a.startup_timeout
        while not self._started.wait(0.2):
            if self.proc.poll() is not None:
                self._started.wait(1.0)          # the reader may still hold its last lines
                raise SupervisorError(f"shmcache serve exited with {self.proc.returncode} "
                                      "before it was ready")
            if time.monotonic() > deadline:
                raise SupervisorError(f"shmcache serve was not ready after "
                                      f"{self.a.startup_timeout:g} s")
        import httpx
        self._http = httpx.Client(base_url=self.url, timeout=30.0)
        while True:
            try:
                if self._http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SupervisorError("shmcache serve never answered /health with 200")
            time.sleep(0.1)
        if self.pool is None:                    # the backend's default name
            self.pool = f"serve-{self.proc.pid}"
        self.model_id = self._http.get("/v1/models").json()["data"][0]["id"]
        self.workers()

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.log.append(line)
            if self.pool is None and (m := self.POOL_RE.search(line)):
                self.pool = m.group(1)
            if self.url is None and (m := self.URL_RE.search(line)):
                self.url = m.group(1)
                self._started.set()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(list(self.log)[-n:])

    def metrics(self) -> dict:
        """The unlabelled samples of /metrics: {name: value}."""
        out = {}
        for line in self._http.get("/metrics").text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def workers(self) -> list:
        """The server's live worker processes (remembered, to check they end)."""
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        out = []
        for k in kids:
            try:
                if WORKER_MODULE in " ".join(k.cmdline()):
                    out.append(k)
                    self.worker_pids.add((k.pid, k.create_time()))
            except psutil.Error:
                pass
        return out

    def kill_a_worker(self) -> bool:
        """SIGKILL one random worker, if every worker is up; whether one was."""
        try:
            if self.metrics().get("shmcache_workers_alive", 0) < self.a.workers:
                return False          # one is still loading the model: let it
        except Exception:
            return False
        ws = self.workers()
        if not ws:
            return False
        try:
            random.choice(ws).send_signal(signal.SIGKILL)
        except psutil.Error:
            return False
        return True

    def stop(self) -> dict:
        """SIGTERM and wait; then what it left: its pool, its worker processes."""
        if self._http is not None:
            self._http.close()
        forced = False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                forced = True
                self.proc.kill()
                self.proc.wait(10)
        left = {"server_exit_code": None if self.proc is None else self.proc.returncode,
                "server_killed": forced, "pool_left": False, "processes_left": []}
        for pid, t in self.worker_pids:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - t) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    left["processes_left"].append(pid)
                    p.kill()
            except psutil.Error:
                pass
        pool = self.pool or (self.proc and f"serve-{self.proc.pid}")
        if pool:
            from shmcache import segment
            if os.path.exists(segment.path_for(pool)):
                left["pool_left"] = True
                segment.unlink(pool)    # ours: the server's own pool, named after its pid
        return left


class PoolSampler:
    """Reads the server's pool from outside, read-only (``PoolView``: no slot,
    no lock): peak blocks in use and peak blocks listed by live tables."""

    def __init__(self, pool: str) -> None:
        from shmcache.inspect_pool import PoolView, block_bytes
        self.view = PoolView(pool)
        lay = self.view.layout
        self.max_blocks = lay.max_blocks
        self.block_bytes = block_bytes(lay)
        self.peak_blocks = self.peak_table_blocks = 0
        self.used = 0.0

    def in_use(self) -> tuple:
        """(blocks referenced, besides the null block; blocks listed by live tables)."""
        from shmcache import recovery
        s = recovery.scan_stats(self.view)
        t = self.view.tables
        return s["allocated_blocks"] - 1, int(t["length"][t["state"] == 1].sum())

    def sample(self) -> None:
        blocks, table_blocks = self.in_use()
        self.peak_blocks = max(self.peak_blocks, blocks)
        self.peak_table_blocks = max(self.peak_table_blocks, table_blocks)
        self.used = blocks / (self.max_blocks - 1)

    def settle(self, timeout: float) -> int:
        """Waits until nothing is referenced; the blocks still referenced."""
        deadline = time.monotonic() + timeout
        while True:
            blocks, table_blocks = self.in_use()
            if (blocks == 0 and table_blocks == 0) or time.monotonic() > deadline:
                return blocks
            time.sleep(0.05)

    def close(self) -> None:
        self.view.close()


class Run:
    def __init__(self, a) -> None:
        self.a = a
        self.reqs = workload.build(a.requests, a.seed, a.system_tokens, a.max_new_tokens)
        self.by_id = {r.id: r for r in self.reqs}
        self.results: dict = {}
        self.failures: dict = {}
        self.in_flight = 0
        self.kills = 0
        self.lock = threading.Lock()
        self.local = threading.local()
        self.server = Server(a)
        self.sampler = None
        self.tokenizer = None

    # --------------------------------------------------------------- setup
    def _pool_blocks(self) -> int:
        if self.a.max_blocks:
            return self.a.max_blocks
        return 1 + sum(workload.blocks_needed(r, self.a.block_size) for r in self.reqs)

    def _load_tokenizer(self):
        import shmcache  # noqa: F401  (before MLX, or shmcache.blas warns it came too late)
        from mlx_lm.utils import load_tokenizer
        path = self.a.model
        if path is None:
            from shmcache.demo_model import ensure_demo_model
            path = ensure_demo_model()      # the server's default; built here once if need be
        return load_tokenizer(path)

    # ------------------------------------------------------------ requests
    def _client(self):
        c = getattr(self.local, "client", None)
        if c is None:
            import openai
            c = self.local.client = openai.OpenAI(base_url=self.server.url + "/v1",
                                                  api_key="none", max_retries=0, timeout=600.0)
        return c

    def _salt(self, r):
        if self.a.no_prefix_cache:
            return f"{r.salt or 'default'}-request-{r.id}"   # nobody else's blocks
        return r.salt

    def _one(self, r) -> dict:
        with self.lock:
            self.in_flight += 1
        try:
            extra = {}
            if self._salt(r):
                extra["cache_salt"] = self._salt(r)
            if r.top_k:
                extra["top_k"] = r.top_k
            texts = [[] for _ in range(r.n)]
            ttft = usage = None
            t0 = time.perf_counter()
            stream = self._client().completions.create(
                model=self.server.model_id, prompt=r.prompt, max_tokens=r.max_new_tokens, n=r.n,
                temperature=r.temperature, seed=r.seed, stream=True,
                stream_options={"include_usage": True}, extra_body=extra or None)
            for chunk in stream:
                for c in chunk.choices:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    texts[c.index].append(c.text or "")
                if chunk.usage is not None:
                    usage = chunk.usage
            if usage is None:
                raise RuntimeError("the stream ended without usage")
            details = usage.prompt_tokens_details
            outputs, exact = [], True
            for parts in texts:
                text = "".join(parts)
                exact &= "\ufffd" not in text
                outputs.append(list(self.tokenizer.encode(text, add_special_tokens=False)))
            exact &= sum(len(o) for o in outputs) == usage.completion_tokens
            return {"id": r.id, "worker": -1, "prompt_tokens": usage.prompt_tokens,
                    "cached_tokens": (details.cached_tokens or 0) if details else 0,
                    "outputs": outputs, "ttft_s": ttft, "preemptions": 0, "n": r.n,
                    "tenant": r.salt or "default", "completion_tokens": usage.completion_tokens,
                    "outputs_exact": bool(exact)}
        finally:
            with self.lock:
                self.in_flight -= 1

    # ---------------------------------------------------------- the run
    def _progress(self, t0: float, gen0: float, final: bool = False) -> None:
        if self.a.quiet:
            return
        done, total = len(self.results) + len(self.failures), len(self.reqs)
        try:
            m = self.server.metrics()
            gen = m.get("shmcache_generation_tokens_total", gen0) - gen0
            restarts = int(m.get("shmcache_worker_restarts_total", 0))
        except Exception:
            gen, restarts = float("nan"), -1
        rs = list(self.results.values())
        prompt = sum(r["prompt_tokens"] for r in rs)
        hit = sum(r["cached_tokens"] for r in rs) / prompt if prompt else 0.0
        dt = time.perf_counter() - t0
        bar = "#" * int(20 * done / total) + "." * (20 - int(20 * done / total))
        line = (f"[{bar}] {done}/{total} done, {self.in_flight} in flight | "
                f"{gen / dt if dt else 0:6.1f} tok/s | hit rate {hit:4.0%} | "
                f"pool {self.sampler.used:5.1%} used | restarts {restarts} | {dt:5.1f}s")
        if sys.stderr.isatty():
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def run(self) -> dict:
        self.tokenizer = self._load_tokenizer()
        self.server.start(self._pool_blocks())
        self.sampler = PoolSampler(self.server.pool)
        m0 = self.server.metrics()
        gen0 = m0.get("shmcache_generation_tokens_total", 0.0)
        pool = ThreadPoolExecutor(self.a.concurrency, thread_name_prefix="client")
        try:
            t0 = time.perf_counter()
            futs = {pool.submit(self._one, r): r.id for r in self.reqs}
            pending = set(futs)
            last_kill = last_progress = time.perf_counter()
            while pending:
                done, pending = wait_futures(pending, timeout=0.05, return_when=FIRST_COMPLETED)
                for f in done:
                    rid = futs[f]
                    try:
                        self.results[rid] = f.result()
                    except Exception as e:
                        self.failures[rid] = f"{type(e).__name__}: {e}"
                self.sampler.sample()
                if self.server.proc.poll() is not None:
                    raise SupervisorError(f"shmcache serve exited with {self.server.proc.returncode} "
                                          "during the run")
                now = time.perf_counter()
                every = self.a.kill_worker_every
                if every and pending and now - last_kill >= every:
                    self.kills += self.server.kill_a_worker()
                    last_kill = now
                if now - last_progress >= (0.5 if sys.stderr.isatty() else 3.0):
                    self._progress(t0, gen0)
                    last_progress = now
            wall = time.perf_counter() - t0
            self._progress(t0, gen0, final=True)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return self.report(wall)

    def report(self, wall: float) -> dict:
        smp = self.sampler
        leaked = smp.settle(SETTLE_S)
        self.server.workers()              # remembers restarted ones too, to check they end
        check = smp.view.fsck()            # what `shmcache fsck POOL` does: read-only
        stats = smp.view.stats()
        m = self.server.metrics()
        reqs = [self.results[k] for k in sorted(self.results)]
        prompt = sum(r["prompt_tokens"] for r in reqs)
        gen = sum(r["completion_tokens"] for r in reqs)
        return {
            "requests": reqs,
            "failed": {str(k): v for k, v in sorted(self.failures.items())},
            "workers": self.a.workers,
            "model": self.server.model_id,
            "pool": self.server.pool,
            "prefix_cache": not self.a.no_prefix_cache,
            "prefix_hit_rate": (sum(r["cached_tokens"] for r in reqs) / prompt) if prompt else 0.0,
            "leaked_blocks": leaked,
            "check_violations": len(check["problems"]),
            "check_problems": check["problems"],
            "worker_restarts": int(m.get("shmcache_worker_restarts_total", 0)),
            "worker_kills": self.kills,
            "preemptions": int(m.get("shmcache_preemptions_total", 0)),
            "cow_copies": stats["cow_copies"],
            "evictions": stats["evictions"],
            "max_blocks": smp.max_blocks,
            "kv_bytes_per_block": smp.block_bytes,
            "kv_bytes_in_pool": smp.peak_blocks * smp.block_bytes,
            "kv_bytes_without_sharing": smp.peak_table_blocks * smp.block_bytes,
            "wall_s": wall,
            "generated_tokens": gen,
            "throughput_tokens_per_s": gen / wall if wall else 0.0,
            "throughput_requests_per_s": len(reqs) / wall if wall else 0.0,
            "ttft_cached_s": _percentiles([r["ttft_s"] for r in reqs if r["cached_tokens"]]),
            "ttft_uncached_s": _percentiles([r["ttft_s"] for r in reqs if not r["cached_tokens"]]),
            "outputs_inexact": [r["id"] for r in reqs if not r["outputs_exact"]],
        }

    def close(self) -> dict:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        return self.server.stop()


def print_report(r: dict) -> None:
    mb = 1 << 20
    print(f"requests: {len(r['requests'])} done, {len(r['failed'])} failed, "
          f"{r['generated_tokens']} tokens in {r['wall_s']:.1f}s "
          f"({r['throughput_tokens_per_s']:.1f} tok/s, {r['throughput_requests_per_s']:.2f} req/s) "
          f"on {r['workers']} workers, model {r['model']}")
    print(f"prefix cache: {'on' if r['prefix_cache'] else 'off'}, hit rate {r['prefix_hit_rate']:.1%} "
          f"(cached prompt tokens / prompt tokens); cow copies {r['cow_copies']}, "
          f"evictions {r['evictions']}, preemptions {r['preemptions']}")
    print(f"kv memory at peak: {r['kv_bytes_in_pool'] / mb:.1f} MiB in the shared pool vs "
          f"{r['kv_bytes_without_sharing'] / mb:.1f} MiB in private caches (no sharing)")
    for k in ("ttft_cached_s", "ttft_uncached_s"):
        t = r[k]
        name = k[:-2].replace("_", " ")
        if t["n"]:
            print(f"{name}: p50 {t['p50'] * 1e3:.0f} ms, p90 {t['p90'] * 1e3:.0f} ms (n={t['n']}; "
                  "from sending to the first token chunk)")
        else:
            print(f"{name}: no such request")
    print(f"worker restarts {r['worker_restarts']} (kills {r['worker_kills']}); leaked blocks "
          f"{r['leaked_blocks']}; check violations {r['check_violations']}")
    left = r.get("server_stop")
    if left is not None:
        print(f"server stopped (exit {left['server_exit_code']}"
              f"{', killed after ' + str(int(STOP_TIMEOUT_S)) + ' s' if left['server_killed'] else ''}); "
              f"pool {'LEFT in /dev/shm (removed now)' if left['pool_left'] else 'removed'}"
              + (f"; worker processes left: {left['processes_left']}" if left['processes_left'] else ""))
    if r["outputs_inexact"]:
        print(f"note: the text of requests {r['outputs_inexact']} does not map back to the exact "
              "token ids generated (not valid UTF-8, or an end-of-sequence token)")
    for rid, err in r["failed"].items():
        print(f"request {rid} failed: {err}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    run = Run(args)
    report = None
    try:
        report = run.run()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the server", file=sys.stderr)
        run.close()
        return 130
    except SupervisorError as e:
        print(f"\nshmcache supervisor: {e}", file=sys.stderr)
        tail = run.server.log_tail()
        if tail:
            print("the server's last log lines:\n" + tail, file=sys.stderr)
        run.close()
        return 2
    except BaseException:
        run.close()
        raise
    report["server_stop"] = stop = run.close()
    if stop["server_exit_code"] != 0:
        print(f"shmcache serve exited with {stop['server_exit_code']} when stopped; its last "
              "log lines:\n" + run.server.log_tail(), file=sys.stderr)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = (report["leaked_blocks"] or report["check_violations"] or report["failed"]
           or stop["server_exit_code"] != 0 or stop["pool_left"] or stop["processes_left"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""One run of the demo driver: the workload sent to the server from a few
client threads at once (so that it batches them), progress, worker kills,
and the report's figures.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from . import workload
from .pool_sampler import PoolSampler
from .report import percentiles
from .serve_process import Server, SupervisorError

SETTLE_S = 5.0            # how long the workers get to release a finished request's blocks
# asked after the workload, greedy, one at a time: the report prints the answers
QUESTIONS = ("What is the capital of France?", "How many days are in a week?",
             "Name a primary color.")
ANSWER_TOKENS = 32


class Run:
    """The workload against one server (``a``: the options), then its report."""

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
        import shmcache  # noqa: F401  (before MLX, or shmcache.system.blas warns it came too late)
        from mlx_lm.utils import load_tokenizer
        from shmcache.models.model_source import resolve_model
        # the server's default (SmolLM2, else the demo model), converted or built here once;
        # the server is then given that directory
        path = resolve_model(self.a.model, log=lambda s: print(s, file=sys.stderr, flush=True))
        self.a.model = str(path)
        return load_tokenizer(path)

    def _ask(self) -> list:
        """The QUESTIONS, one at a time, greedy: [{"question", "answer"}]."""
        out = []
        for q in QUESTIONS:
            r = self._client().chat.completions.create(
                model=self.server.model_id, messages=[{"role": "user", "content": q}],
                max_tokens=ANSWER_TOKENS, temperature=0.0)
            out.append({"question": q, "answer": r.choices[0].message.content,
                        "finish_reason": r.choices[0].finish_reason})
        return out

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
        answers = self._ask()
        out = self.report(wall)
        out["answers"] = answers
        return out

    def report(self, wall: float) -> dict:
        """The run's figures (the JSON report), read once the workers are idle."""
        smp = self.sampler
        leaked = smp.settle(SETTLE_S)
        self.server.workers()              # remembers restarted ones too, to check they end
        check = smp.view.fsck()            # what `shmcache fsck POOL` does: read-only
        stats = smp.view.stats()
        m = self.server.metrics()
        reqs = [self.results[k] for k in sorted(self.results)]
        prompt = sum(r["prompt_tokens"] for r in reqs)
        gen = sum(r["completion_tokens"] for r in reqs)
        out = {
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
            "ttft_cached_s": percentiles([r["ttft_s"] for r in reqs if r["cached_tokens"]]),
            "ttft_uncached_s": percentiles([r["ttft_s"] for r in reqs if not r["cached_tokens"]]),
            "outputs_inexact": [r["id"] for r in reqs if not r["outputs_exact"]],
        }
        if self.a.l2:
            from shmcache.l2 import FLUSH_S
            out["l2_url"] = self.server.l2_url
            out["l2"] = smp.l2_counters(settle_s=2 * FLUSH_S)
        return out

    def close(self) -> dict:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        return self.server.stop()

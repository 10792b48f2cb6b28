"""The supervisor of ``shmcache serve``: a pool, worker processes, routing.

:class:`WorkerBackend` creates the pool (its layout and dtype read from the
model), starts ``--workers`` worker processes (``shmcache.server.worker``)
that attach to it by name, and sends each request to the least-loaded live
worker. The cache is shared, so any worker finds any other's prefixes: no
cache-aware routing is needed. One exception: a request whose first block
is being prefilled by a worker right now goes to that worker, so that two
workers never compute one uncached prefix at the same time.

When a worker dies, the pool releases what it held (``reclaim_dead``), a
new worker is started in its place, and its requests are re-run on the
others from their prompts. Sampling is seeded per request and sample, so
the re-run produces the same tokens; the supervisor drops the ones it
already delivered, and the client sees one complete answer.

With ``l2`` (a Redis URL), the workers use Redis as a second tier (see
``shmcache.l2``): the supervisor computes the model's identity once and
passes it, with the cluster secret if there is one (without, each worker
uses the pool's own secret: nothing is shared with other pools), to every
worker, which attaches to the pool with ``l2=``. ``stats()`` reads the L2
counters from the pool (every worker adds to them, a dead one's stay) and
``l2_up`` from the workers' reports.

NOTE: everything here runs on the server's event loop; the only blocking
calls are the pool's (microseconds) and the workers' pipe writes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import signal
import sys
from pathlib import Path
from typing import AsyncIterator, Optional

import msgspec

import shmcache

from ..layout import FLAG_CACHED
from . import wire
from .protocol import Error, SampleDone, SamplingParams, Started, Tokens

log = logging.getLogger("shmcache.server")

DEFAULT_POOL_BYTES = 1 << 30          # the pool's K/V when --max-blocks is not given


class _Flight:
    """One request in flight: where it runs, what was delivered."""

    def __init__(self, rid: int, prompt: list, params: SamplingParams, seed: int) -> None:
        self.gen = wire.Gen(rid, prompt, params, seed)
        self.q: asyncio.Queue = asyncio.Queue()
        self.worker: Optional["_Worker"] = None
        self.started = False
        self.delivered = [0] * params.n        # tokens delivered per sample
        self.seen = [0] * params.n             # tokens seen in the current run
        self.done = [False] * params.n


class _Worker:
    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.ready = asyncio.Event()
        self.flights: dict = {}
        self.load = 0
        self.preemptions = 0
        self.working_bytes = 0
        self.l2: dict = {}                 # its L2 counters and "up", as last reported
        self.reader: Optional[asyncio.Task] = None
        self.enc = msgspec.msgpack.Encoder()

    def send(self, msg) -> None:
        body = self.enc.encode(msg)
        self.proc.stdin.write(len(body).to_bytes(4, "little") + body)


class WorkerBackend:
    """Worker processes over one shared pool (see the module docstring).

    Args:
        model: an mlx-lm model directory.
        workers: worker processes.
        max_blocks: pool blocks (default: what fits in 1 GiB of K/V).
        block_size: tokens per block.
        max_n: the largest ``n`` a request may ask for.
        pool_name: the pool's name (default ``serve-<pid>``).
        l2: a Redis URL: the L2 tier (None: L1 only).
        cluster_secret: the secret shared by the pools that share L2 entries
            (None: the pool's own, shared with no other pool).
        l2_timeout, l2_retry, l2_ttl: seconds: each L2 socket operation of
            a lookup, between attempts during an outage, a value's life
            (None: until Redis evicts it).
    """

    def __init__(self, model, workers: int = 2, max_blocks: Optional[int] = None,
                 block_size: int = 16, max_n: int = 16, pool_name: Optional[str] = None,
                 max_batch: int = 32, l2: Optional[str] = None,
                 cluster_secret: Optional[str] = None, l2_timeout: Optional[float] = None,
                 l2_retry: Optional[float] = None, l2_ttl: Optional[int] = None) -> None:
        from mlx_lm.utils import load_tokenizer
        self.path = Path(model)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"--model {model}: not an mlx-lm model directory (no config.json)")
        self.model_id = self.path.name
        self.tokenizer = load_tokenizer(self.path)
        self.n_workers = workers
        self.max_n = max_n
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_batch = max_batch
        self.pool_name = pool_name or f"serve-{os.getpid()}"
        self.mgr = None
        self.workers: list = []
        self.restarts = 0
        self._ids = itertools.count(1)
        self._closing = False
        self._started = False           # every worker was ready once: restart the dead ones
        self.l2_url = l2
        self.l2_timeout, self.l2_retry, self.l2_ttl = l2_timeout, l2_retry, l2_ttl
        self._l2_secret = cluster_secret.encode() if cluster_secret else None
        self.l2_shared = bool(cluster_secret)
        self.l2_model_id: Optional[str] = None
        if l2:
            from ..l2 import check_url
            check_url(l2)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        # On this (the main) thread, not in an executor: pool_layout runs the
        # model once, which fills MLX's *thread-local* compile cache (swiglu,
        # ...). An executor thread destroys that cache at its exit, after
        # Python has let it go, and the destructor takes the GIL: racing the
        # interpreter's finalization at shutdown, that aborted the server
        # ("terminate called without an active exception", exit 134).
        self._create_pool()
        self.workers = [_Worker(i) for i in range(self.n_workers)]
        for w in self.workers:
            await self._spawn(w)
        log.info("loading the model in %d workers...", self.n_workers)
        ready = asyncio.gather(*(w.ready.wait() for w in self.workers))
        while not ready.done():
            await asyncio.wait([ready], timeout=0.2)
            dead = [w for w in self.workers if w.proc.returncode is not None]
            if dead:
                ready.cancel()
                raise RuntimeError(f"worker {dead[0].idx} exited with {dead[0].proc.returncode} "
                                   f"while loading the model (its error is above)")
        self._started = True
        log.info("all %d workers ready (pool %s: %d blocks of %d tokens)", self.n_workers,
                 self.pool_name, self.mgr.max_blocks, self.block_size)

    def _create_pool(self) -> None:
        import mlx.core as mx  # noqa: F401  (after shmcache: the fast BLAS)
        from mlx_lm.utils import load_model

        from ..mlx_lm import pool_layout
        model, _ = load_model(self.path, lazy=True)
        lay = pool_layout(model)
        del model
        per_block = 2 * lay["num_layers"] * lay["num_kv_heads"] * lay["head_dim"] \
            * self.block_size * (4 if lay["dtype"] == "float32" else 2)
        if self.max_blocks is None:
            self.max_blocks = max(64, min(1 << 20, DEFAULT_POOL_BYTES // per_block))
        self.mgr = shmcache.create_pool(
            self.pool_name, block_size=self.block_size, max_blocks=self.max_blocks,
            max_slots=max(64, 4 * self.n_workers), max_refs=16 * self.max_blocks,
            max_tables=max(1024, 4 * self.max_batch * self.n_workers), **lay)
        self.layout = lay
        if self.l2_url:
            self._start_l2()

    def _start_l2(self) -> None:
        from .. import l2
        self.l2_model_id = l2.model_identity(self.path)
        client = l2.connect(self.l2_url, 1.0)       # (raises without redis-py)
        try:
            ok = bool(client.ping())
        except Exception as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        finally:
            client.close()
        log.info("L2: %s (%s), %s secret, model %s", l2.redact(self.l2_url),
                 "reachable" if ok else f"not reachable now ({why}); the workers retry",
                 "the cluster" if self.l2_shared else "this pool's own",
                 self.l2_model_id)

    async def _spawn(self, w: _Worker) -> None:
        w.ready.clear()
        env = dict(os.environ)
        extra = []
        if self.l2_url:
            if self._l2_secret is not None:
                from .worker import L2_SECRET_ENV
                env[L2_SECRET_ENV] = self._l2_secret.hex()
            extra = ["--l2", self.l2_url, "--l2-model-id", self.l2_model_id]
            for flag, v in (("--l2-timeout", self.l2_timeout), ("--l2-retry", self.l2_retry),
                            ("--l2-ttl", self.l2_ttl)):
                if v is not None:
                    extra += [flag, str(v)]
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shmcache.server.worker", "--pool", self.pool_name,
            "--model", str(self.path), "--id", str(w.idx), "--max-batch", str(self.max_batch),
            *extra, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            start_new_session=True)          # Ctrl-C reaches the server, which stops them
        w.reader = asyncio.create_task(self._read(w, w.proc))

    async def close(self) -> None:
        self._closing = True
        for w in self.workers:
            if w.proc and w.proc.returncode is None:
                try:
                    w.send(wire.Stop())
                    w.proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError, RuntimeError):
                    pass
        for w in self.workers:
            if w.proc:
                try:
                    await asyncio.wait_for(w.proc.wait(), 10)
                except asyncio.TimeoutError:
                    w.proc.kill()
                    await w.proc.wait()
        for w in self.workers:
            for f in w.flights.values():
                f.q.put_nowait(Error("the server is shutting down", 503))
        if self.mgr is not None:
            self.mgr.destroy()
            self.mgr = None

    # -------------------------------------------------------------- routing
    def _pick(self) -> Optional[_Worker]:
        live = [w for w in self.workers if w.ready.is_set() and w.proc.returncode is None]
        if not live:
            return None
        return min(live, key=lambda w: (sum(f.gen.params.n for f in w.flights.values()), w.idx))

    def _prefilling_same_prefix(self, f: _Flight) -> Optional[_Worker]:
        """A live worker that is prefilling a request whose first block is
        ``f``'s: sent there, ``f`` finds that prefix published instead of
        computing it a second time in parallel (a worker prefills one
        request at a time)."""
        head = f.gen.prompt[:self.block_size]
        if len(head) < self.block_size:
            return None
        for w in self.workers:
            if w.ready.is_set() and w.proc.returncode is None and any(
                    not g.started and g.gen.prompt[:self.block_size] == head
                    and g.gen.params.salt == f.gen.params.salt for g in w.flights.values()):
                return w
        return None

    async def _dispatch(self, f: _Flight) -> None:
        w = self._prefilling_same_prefix(f) or self._pick()
        while w is None:
            if self._closing:
                f.q.put_nowait(Error("the server is shutting down", 503))
                return
            await asyncio.sleep(0.05)
            w = self._pick()
        f.worker = w
        f.seen = [0] * len(f.seen)
        w.flights[f.gen.id] = f
        w.send(f.gen)

    # ---------------------------------------------------------- interface
    def admission_error(self, prompt_tokens: int, max_tokens: int, n: int) -> Optional[str]:
        bs = self.block_size
        total = (self.max_blocks or 0) - 1
        need = -(-(prompt_tokens + max_tokens) // bs) * n
        if need > total:
            return (f"the prompt ({prompt_tokens} tokens) with max_tokens={max_tokens} and n={n} "
                    f"needs {need} blocks of {bs} tokens; the pool has {total}")
        return None

    async def generate(self, prompt: list, params: SamplingParams) -> AsyncIterator:
        seed = params.seed if params.seed is not None else random.randrange(2**31)
        f = _Flight(next(self._ids), list(prompt), params, seed)
        await self._dispatch(f)
        finished = 0
        try:
            while finished < params.n:
                ev = await f.q.get()
                yield ev
                if isinstance(ev, Error):
                    return
                finished += isinstance(ev, SampleDone)
        finally:
            if not all(f.done) and f.worker is not None:
                f.worker.flights.pop(f.gen.id, None)
                try:
                    f.worker.send(wire.Cancel(f.gen.id))
                except Exception:        # the worker is gone; nothing to cancel
                    pass

    def stats(self) -> dict:
        m = self.mgr
        if m is None:
            return {}
        # Block 0 (the null block) is always referenced and never cached:
        # leave it out. A cached block with no references sits on the free
        # list (evicted when taken), so get_stats()'s free_blocks counts it,
        # and its total_tokens_cached is the tokens of *referenced* blocks:
        # neither says what the prefix cache holds. Count the flags instead.
        # NOTE: read without the pool lock: a scrape must not hold up the
        # workers for a scan of every block, and a gauge may be a moment stale.
        n = m.max_blocks
        ref = m._p.blocks["ref_count"][1:n] > 0
        cached = (m._p.blocks["flags"][1:n] & FLAG_CACHED) != 0
        used, n_cached, free = int(ref.sum()), int(cached.sum()), int((~ref & ~cached).sum())
        held = int((ref | cached).sum())
        lay = m.layout
        per_block = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * lay.block_size * (
            4 if lay.dtype == "float32" else 2)
        out = dict(blocks_total=n - 1, blocks_used=used, blocks_free=free, blocks_cached=n_cached,
                   pool_kv_bytes=held * per_block,
                   preemptions=sum(w.preemptions for w in self.workers),
                   worker_restarts=self.restarts,
                   workers_alive=sum(1 for w in self.workers if w.ready.is_set()
                                     and w.proc.returncode is None),
                   working_bytes=sum(w.working_bytes for w in self.workers))
        if self.l2_url:
            out.update(self.l2_stats())
        return out

    def l2_stats(self) -> dict:
        """The pool's L2 counters (``l2_<name>``: every worker's, summed by
        the pool, a dead worker's included), and ``l2_up``: 1 when every
        live worker that reported finds L2 answering."""
        # NOTE: read without the pool lock, as the gauges above: each worker
        # adds its deltas under the lock every 0.5 s; a scrape may be a
        # moment behind, never torn (one aligned int64 each).
        out = {f"l2_{k}": v for k, v in self.mgr.l2_counters().items()}
        up = 1
        for w in self.workers:
            if w.l2 and w.proc is not None and w.proc.returncode is None:
                up = min(up, w.l2.get("up", 1))
        out["l2_up"] = up
        return out

    # ---------------------------------------------------------- a worker's events
    async def _read(self, w: _Worker, proc) -> None:
        dec = wire.from_worker
        try:
            while True:
                head = await proc.stdout.readexactly(4)
                body = await proc.stdout.readexactly(int.from_bytes(head, "little"))
                self._on(w, dec.decode(body))
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        await proc.wait()
        if not self._closing and self._started:
            await self._died(w, proc.returncode)

    def _on(self, w: _Worker, msg) -> None:
        if isinstance(msg, wire.Step):
            for rid, sample, tok, reason in msg.items:
                f = w.flights.get(rid)
                if f is None or f.done[sample]:
                    continue
                f.seen[sample] += 1
                if f.seen[sample] > f.delivered[sample]:      # not delivered before a re-run
                    f.delivered[sample] += 1
                    f.q.put_nowait(Tokens(sample, [tok]))
                    if reason:
                        f.done[sample] = True
                        f.q.put_nowait(SampleDone(sample, reason))
                if all(f.done):
                    w.flights.pop(rid, None)
        elif isinstance(msg, wire.Admitted):
            f = w.flights.get(msg.id)
            if f is None:
                return
            # every admission (the first, a re-run after a preemption, or on
            # another worker after a death) generates from the first token
            # again: count anew, and pass on only what was not delivered
            f.seen = [0] * len(f.seen)
            if not f.started:
                f.started = True
                f.q.put_nowait(Started(msg.prompt_tokens, msg.cached_tokens, w.idx))
        elif isinstance(msg, wire.Failed):
            f = w.flights.pop(msg.id, None)
            if f is not None:
                f.q.put_nowait(Error(msg.message, msg.status))
        elif isinstance(msg, wire.Load):
            w.preemptions, w.working_bytes = msg.preemptions, msg.working_bytes
            if msg.l2:
                w.l2 = msg.l2
        elif isinstance(msg, wire.Ready):
            w.ready.set()

    async def _died(self, w: _Worker, rc) -> None:
        flights = list(w.flights.values())
        w.flights.clear()
        w.ready.clear()
        w.l2 = {}                          # (its counters are the pool's: they stay)
        log.warning("worker %d (pid %d) died (exit %s); re-running its %d requests",
                    w.idx, w.proc.pid, rc if rc is None or rc >= 0 else signal.Signals(-rc).name,
                    len(flights))
        if self.mgr is not None:
            self.mgr.reclaim_dead()
        self.restarts += 1
        await self._spawn(w)
        for f in flights:
            await self._dispatch(f)

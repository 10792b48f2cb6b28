"""The supervisor's worker processes: the pool they share, their lives.

:class:`WorkerProc` is one worker process as the supervisor sees it (its
pipes, its requests in flight, what it last reported). :class:`WorkerLifecycle`
is the part of :class:`~shmcache.server.backend.WorkerBackend` that creates
the pool (its layout and dtype read from the model), starts the workers
(``python -m shmcache.server.worker``, attached to the pool by name, with
the L2 flags when there is an L2 tier), reads what they send, restarts one
that dies (after the pool released what it held) and stops them all.

Which worker a request goes to, and what a worker's messages mean for the
requests, is the routing's, in ``backend.py``: this mixin calls its
``_on`` (one message) and ``_dispatch`` (send a request to a worker).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Optional

import msgspec

import shmcache

from . import wire
from .protocol import Error

log = logging.getLogger("shmcache.server")

DEFAULT_POOL_BYTES = 1 << 30          # the pool's K/V when --max-blocks is not given



def blas_threads_per_worker(workers: int) -> int:
    """BLAS threads for each of ``workers`` processes: this process's CPUs
    divided among them, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, workers))

class WorkerProc:
    """One worker process: its pipes, its requests in flight, its reports."""

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


class WorkerLifecycle:
    """Starting, watching, restarting and stopping the worker processes
    (a mixin of ``WorkerBackend``, which sets the attributes used here)."""

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        # On this (the main) thread, not in an executor: pool_layout runs the
        # model once, which fills MLX's *thread-local* compile cache (swiglu,
        # ...). An executor thread destroys that cache at its exit, after
        # Python has let it go, and the destructor takes the GIL: racing the
        # interpreter's finalization at shutdown, that aborted the server
        # ("terminate called without an active exception", exit 134).
        self._create_pool()
        self.workers = [WorkerProc(i) for i in range(self.n_workers)]
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

    async def _spawn(self, w: WorkerProc) -> None:
        w.ready.clear()
        env = dict(os.environ)
        # the CPUs shared out among the workers: each one's BLAS gets its
        # share as threads (at least 1), unless the operator chose
        env.setdefault("SHMCACHE_BLAS_THREADS", str(blas_threads_per_worker(self.n_workers)))
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
            "--prefill-step", str(self.prefill_step), *extra,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
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

    # ---------------------------------------------------------- a worker's pipe
    async def _read(self, w: WorkerProc, proc) -> None:
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

    async def _died(self, w: WorkerProc, rc) -> None:
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

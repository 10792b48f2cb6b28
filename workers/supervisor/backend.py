"""The supervisor of ``shmcache serve``: a pool, worker processes, routing.

:class:`WorkerBackend` creates the pool (its layout and dtype read from the
model), starts ``--workers`` worker processes (``workers.worker.main``)
that attach to it by name, and sends each request to the least-loaded live
worker. The cache is shared, so any worker finds any other's prefixes: no
cache-aware routing is needed. One rule keeps a prefix from being computed
twice at once: a request whose prompt shares whole blocks with a prompt
that some worker is prefilling right now waits, here, until those blocks
are published (the worker's ``Progress``), and then goes to the
least-loaded worker like any other; with one system prompt under load,
every worker is busy, and the prompt is computed once. A worker's load
counts the samples it runs or will run plus its prefill work still to do,
in steps of ``prefill_step`` tokens.

Prefill handoff (``handoff_tokens``, on by default with two or more
workers). On a CPU a decode step reads every weight once whatever its rows
(1 row or 4 cost about the same), while a prefill is bound by compute. With
fewer requests in flight than workers, each goes to the least-loaded worker
(an idle one: its prefill pauses nobody). From as many as workers on
(``_crowded``), a request with at least ``handoff_tokens`` prompt tokens
the pool does not hold is sent first, for its prefill only (``Gen.handoff``), to a worker
that decodes nothing if there is one (the least prefill queued, then the
fewest rows: else a decoding worker's few rows pause for it); that
worker computes it into the pool and keeps its table (``Handoff``). The
request then goes (``Gen.adopt``) to a decoding worker: the fullest one
with room under ``pack_rows`` rows and no prefill queued, else the emptiest
without prefill. It forks the table and joins its batch with nothing to
compute; once it says so (``Admitted``) the first worker drops its table
(``Unpark``). The decoding workers' batches fill up and stop for a long
prompt only when every worker decodes, and the prompts are computed on the
other workers' cores at the same time. A shorter rest (a later chat turn whose history is cached
save a few tokens) goes straight to a decoding worker with room. If the prefilling
worker dies after its handoff, the adopter computes what the pool lacks.

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

Creating the pool and starting, restarting and stopping the worker
processes is :class:`~workers.supervisor.worker_procs.WorkerProcesses`'s,
which :class:`WorkerBackend` holds (``procs``) and gives its two callbacks:
this module routes the requests and turns the workers' messages into each
request's events.

NOTE: everything here runs on the server's event loop; the only blocking
calls are the pool's (microseconds) and the workers' pipe writes.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import random
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

import msgspec

from .. import wire
from ..protocol import Error, SampleDone, SamplingParams, Started, Tokens
from .worker_procs import (DEFAULT_MAX_RERUNS, DEFAULT_STALL_S, Flight, WorkerProc,
                           WorkerProcesses, core_shares, lend_cores_by_default)

log = logging.getLogger("shmcache.server")

#: how long a request for an idle worker waits for its lent cores to come back
RECLAIM_WAIT_S = 0.5


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
        stall_s: a worker silent this long leaves the routing; twice, it is
            killed (``--worker-timeout``).
        max_reruns: re-runs of one request after worker deaths.
        prefill_threads: the threads each worker runs a prefill's softmax
            and SiLU on (``workers/worker/prefill_threads.py``; None:
            ``prefill_threads_per_worker``).
        lend_cores: lend the idle workers' BLAS threads to the busy ones
            (None: ``lend_cores_by_default``; never when
            ``$SHMCACHE_BLAS_THREADS`` is set).
        max_working_bytes: each worker's working K/V bytes (None: half the
            memory shared among the workers).
        handoff_tokens: a request with at least this many prompt tokens not
            in the pool is prefilled on a worker that decodes nothing and
            handed over (0: never; never with one worker).
        pack_rows: with handoff, a decoding worker takes new requests until
            it runs this many samples, before an idle worker starts decoding.
        pin_cores: each worker runs on CPUs of its own, its share, BLAS and
            prefill threads too (``pinned_cpus``); no cores are lent then.

    ``startup_cancelled`` (a callable, set after construction) is polled
    while the workers load the model: True stops ``start``.
    """

    def __init__(self, model, workers: int = 2, max_blocks: Optional[int] = None,
                 block_size: int = 16, max_n: int = 16, pool_name: Optional[str] = None,
                 max_batch: int = 32, l2: Optional[str] = None,
                 cluster_secret: Optional[str] = None, l2_timeout: Optional[float] = None,
                 l2_retry: Optional[float] = None, l2_ttl: Optional[int] = None,
                 prefill_step: int = 512, decoding_prefill_step: Optional[int] = None,
                 prefill_threads: Optional[int] = None, lend_cores: Optional[bool] = None,
                 stall_s: float = DEFAULT_STALL_S, max_reruns: int = DEFAULT_MAX_RERUNS,
                 max_working_bytes: Optional[int] = None, handoff_tokens: int = 32,
                 pack_rows: int = 4, pin_cores: bool = False) -> None:
        from mlx_lm.utils import load_tokenizer
        self.path = Path(model)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"--model {model}: not an mlx-lm model directory (no config.json)")
        self.model_id = self.path.name
        self.tokenizer = load_tokenizer(self.path)
        self.n_workers = workers
        self.max_n = max_n
        self.block_size = block_size
        self.prefill_step = max(block_size, prefill_step // block_size * block_size)
        if handoff_tokens < 0 or pack_rows < 1:
            raise ValueError(f"handoff_tokens must be >= 0 (got {handoff_tokens}) and "
                             f"pack_rows >= 1 (got {pack_rows})")
        self.handoff_tokens = handoff_tokens if workers > 1 else 0
        self.pack_rows = pack_rows
        self._tasks: set = set()           # decode dispatches after a handoff, running
        self._reclaims: dict = {}          # worker index -> its wait for its lent cores
        self.handoffs = 0                  # prefills handed over (a counter)
        # lend idle workers' cores to busy ones (asked for, or by default
        # where each worker has 2 CPUs or more; never where the operator
        # chose the threads)
        if lend_cores is None:
            lend_cores = lend_cores_by_default(workers)
        blas_chosen = bool(os.environ.get("SHMCACHE_BLAS_THREADS", "").strip())
        self.lend_cores = lend_cores and not blas_chosen
        self._changed = asyncio.Event()    # set (and replaced) when a flight moves on
        self.pool_name = pool_name or f"serve-{os.getpid()}"
        self._ids = itertools.count(1)
        self.l2_url = l2
        self.startup_cancelled: Callable[[], bool] = lambda: False
        if l2:
            from shmcache.l2 import check_url
            check_url(l2)
        self.procs = WorkerProcesses(
            self.path, workers, block_size=block_size, max_blocks=max_blocks,
            max_batch=max_batch, prefill_step=self.prefill_step,
            decoding_prefill_step=decoding_prefill_step, prefill_threads=prefill_threads,
            pool_name=self.pool_name,
            on_message=self._on, redispatch=self._dispatch,
            startup_cancelled=lambda: self.startup_cancelled(),
            l2_url=l2, cluster_secret=cluster_secret.encode() if cluster_secret else None,
            l2_timeout=l2_timeout, l2_retry=l2_retry, l2_ttl=l2_ttl, stall_s=stall_s,
            max_reruns=max_reruns, max_working_bytes=max_working_bytes, pin_cores=pin_cores)
        pinned = self.procs.worker_cpus is not None
        if pinned:
            self.lend_cores = False     # a worker's threads cannot reach another's CPUs
        # what the startup line says of the idle workers' cores, and why
        self._lending = ("none (one worker)" if workers == 1 else
                         "lent to the busy ones" if self.lend_cores else
                         "not lent (--pin-cores)" if pinned else
                         "not lent ($SHMCACHE_BLAS_THREADS is set)" if blas_chosen else
                         "not lent (--lend-cores lends them)")

    # -------------------------------------------------------------- the processes'
    @property
    def context_length(self) -> Optional[int]:
        """The model's context length, from its config (None: unknown, or before ``prepare``)."""
        return self.procs.context_length

    def prepare(self) -> None:
        """Reads the model's layout and creates the pool (see
        :meth:`WorkerProcesses.prepare`: call it before serving to fail early)."""
        self.procs.prepare()

    async def start(self) -> None:
        await self.procs.start()
        cpus = self.procs.worker_cpus
        log.info("each worker: %d BLAS thread(s), %d prefill thread(s)%s; idle workers' cores: "
                 "%s", self.procs.workers[0].blas_threads, self.procs.prefill_threads,
                 f", on {len(cpus[0])} CPU(s) of its own (--pin-cores)" if cpus else "",
                 self._lending)

    async def close(self) -> None:
        for task in list(self._tasks) + list(self._reclaims.values()):
            task.cancel()
        await self.procs.close()

    def fail_in_flight(self, message: str = "the server is shutting down",
                       status: int = 503) -> int:
        """Ends every request in flight with an error; returns how many. New
        requests are refused from now on."""
        return self.procs.fail_in_flight(message, status)

    def remove_unserved_pool(self) -> None:
        """Removes the pool if it was created but never served (``shmcache
        serve`` on its way out after a failed or stopped startup)."""
        self.procs.remove_unserved_pool()

    # -------------------------------------------------------------- routing
    def _load(self, w: WorkerProc) -> float:
        """Samples ``w`` runs or will run, plus its prefill still to do (in steps)."""
        load = 0.0
        for f in w.flights.values():
            load += f.gen.params.n
            if not f.started:
                load += max(0, len(f.gen.prompt) - f.progress) / self.prefill_step
        return load

    def _pick(self) -> Optional[WorkerProc]:
        live = self.procs.live()
        if not live:
            return None
        return min(live, key=lambda w: (self._load(w), w.idx))

    @staticmethod
    def _rows(w: WorkerProc) -> int:
        """Samples ``w`` decodes or will decode (not the prefills it runs for a handoff)."""
        return sum(f.gen.params.n for f in w.flights.values() if not f.prefill_only)

    @staticmethod
    def _prefill_left(w: WorkerProc) -> int:
        """Prompt tokens ``w`` has still to compute (as far as its reports say)."""
        return sum(max(0, len(f.gen.prompt) - 1 - f.progress)
                   for f in w.flights.values() if not f.started)

    def _pick_prefill(self) -> Optional[WorkerProc]:
        """Where a handed-over prefill runs: a worker decoding nothing if
        any, the least prefill queued first."""
        live = self.procs.live()
        if not live:
            return None
        return min(live, key=lambda w: (self._rows(w) > 0, self._prefill_left(w),
                                        self._rows(w), w.idx))

    def _pick_decode(self, n: int) -> Optional[WorkerProc]:
        """Where a request decodes under handoff: the fullest decoding
        worker with room for ``n`` more under ``pack_rows`` and no prefill
        queued; else the emptiest without prefill; else the least loaded."""
        live = self.procs.live()
        if not live:
            return None
        idle = [w for w in live if self._prefill_left(w) == 0]
        room = [w for w in idle if 0 < self._rows(w) and self._rows(w) + n <= self.pack_rows]
        if room:
            return max(room, key=lambda w: (self._rows(w), -w.idx))
        if idle:
            return min(idle, key=lambda w: (self._rows(w), w.idx))
        return self._pick()

    def _pick_start(self, f: Flight) -> Optional[WorkerProc]:
        """Where a request that is not handed over runs, prefill and decode:
        with fewer requests than workers (or handoff off), the least-loaded
        worker; else a decoding worker with room (``_pick_decode``)."""
        if not self.handoff_tokens or not self._crowded():
            return self._pick()
        return self._pick_decode(f.gen.params.n)

    def _crowded(self) -> bool:
        """As many requests in flight as live workers: the next one makes
        some worker decode several rows, so packing them and prefilling
        elsewhere pays; with fewer, each request has a worker of its own,
        where its prefill pauses nobody."""
        live = self.procs.live()
        return sum(len(w.flights) for w in live) >= len(live)

    def _in_pool(self, f: Flight) -> int:
        """Tokens of ``f``'s ``prompt[:-1]`` the pool holds now, whole
        blocks (a probe: no reference, not counted as a lookup; 0 without
        a pool)."""
        m = self.procs.mgr
        if m is None:
            return 0
        salt = f.gen.params.salt
        return m.cached_prefix_tokens(f.gen.prompt[:-1], (salt,) if salt else None)

    def _todo(self, f: Flight) -> int:
        """Tokens of ``f``'s ``prompt[:-1]`` not in the pool now."""
        todo = len(f.gen.prompt) - 1
        if todo < self.handoff_tokens:
            return todo
        return todo - self._in_pool(f)

    def _wants_handoff(self, f: Flight) -> bool:
        """Whether ``f``'s prefill should run on another worker than its
        decoding: ``handoff_tokens`` of it are not in the pool now, and the
        workers are crowded (``_crowded``)."""
        if not self.handoff_tokens or f.parked is not None or len(self.procs.live()) < 2 or \
                not self._crowded():
            return False
        return self._todo(f) >= self.handoff_tokens

    def _dispatched(self, task: "asyncio.Task[None]", f: Flight) -> None:
        """A decode dispatch after a handoff ended: one that raised (a bug)
        fails its request instead of leaving the client waiting."""
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error("request %d: dispatch after its handoff failed: %r", f.gen.id,
                  task.exception())
        self._unpark(f)
        f.q.put_nowait(Error(f"dispatch failed: {task.exception()!r}", 500))

    def _unpark(self, f: Flight) -> None:
        """The worker keeping ``f``'s handed-over table may drop it."""
        if f.parked is None:
            return
        w, _ = f.parked
        f.parked = None
        self._send_unpark(w, f.gen.id)

    @staticmethod
    def _send_unpark(w: WorkerProc, rid: int) -> None:
        """Tell ``w`` to drop the table it keeps for request ``rid``."""
        try:
            w.send(wire.Unpark(rid))
        except (OSError, RuntimeError, AttributeError):   # gone: its tables were reclaimed
            pass

    def _shared_blocks_pending(self, f: Flight) -> bool:
        """Whether a request being prefilled on a live worker will publish
        blocks of ``f``'s prompt that are not published yet (same salt,
        same tokens from position 0, whole blocks of ``prompt[:-1]``)."""
        bs = self.block_size
        mine = f.gen.prompt
        for w in self.procs.live():
            # a worker prefills its requests one at a time, in the order
            # they came: only its first one not started is computing (or
            # about to); one queued behind it computes nothing yet, and
            # waiting for it would hold ``f`` back for nothing
            g = next((g for g in w.flights.values() if not g.started), None)
            if g is None or g.gen.params.salt != f.gen.params.salt:
                continue
            theirs = g.gen.prompt
            limit = min(len(mine), len(theirs)) - 1
            done = g.progress // bs * bs
            if done + bs > limit or mine[:bs] != theirs[:bs] \
                    or mine[done:done + bs] != theirs[done:done + bs]:
                continue
            if mine[:done] == theirs[:done]:
                return True
        return False

    def _moved(self) -> None:
        """Wake the requests waiting in ``_dispatch``; share the cores out again."""
        self._changed.set()
        self._changed = asyncio.Event()
        self._lend_cores()

    def _lend_cores(self) -> None:
        """With ``--lend-cores``: tell each worker how many BLAS threads to
        run, the idle workers' cores lent to the decoding ones
        (``core_shares``). Off by default, and when the operator chose the
        threads ($SHMCACHE_BLAS_THREADS). A smaller share goes out at once; a
        larger one only while the cores it adds are free, counting each busy
        worker at the most threads it may still run (told or last reported:
        it applies a new count between two steps and reports it then,
        ``Load``); the reports call this again."""
        if not self.lend_cores:
            return
        live = self.procs.live()
        shares = core_shares([(w.idx, bool(w.flights), self._rows(w) > 0) for w in live],
                             self.procs.cpus, self.procs.blas_share)
        grow = []
        for w in live:
            n = shares[w.idx]
            if n < w.blas_threads:
                self._tell_threads(w, n)
            elif n > w.blas_threads:
                grow.append(w)
        for w in grow:
            if self._cores_in_use(but=w) + shares[w.idx] <= self.procs.cpus:
                self._tell_threads(w, shares[w.idx])

    def _cores_in_use(self, but: WorkerProc) -> int:
        """BLAS threads the busy workers (but ``but``) may be running now."""
        return sum(max(w.blas_threads, w.blas_threads_running) for w in self.procs.live()
                   if w.flights and w is not but)

    @staticmethod
    def _tell_threads(w: WorkerProc, n: int) -> None:
        try:
            w.send(wire.Threads(n))
        except (OSError, RuntimeError, AttributeError):   # dying: the heartbeat acts
            return
        if n < w.blas_threads:
            # until it reports the smaller count, it may run what it was told
            # before (applied, and its report not read yet)
            w.blas_threads_running = max(w.blas_threads_running, w.blas_threads)
        w.blas_threads = n

    def _lent_out(self, w: WorkerProc) -> bool:
        """Whether a busy worker other than ``w`` may still run more threads
        than it was told (``core_shares`` keeps the told counts within the
        CPUs)."""
        return any(o.blas_threads_running > o.blas_threads for o in self.procs.live()
                   if o.flights and o is not w)

    async def _cores_back(self, w: WorkerProc) -> None:
        """``w`` was idle and gets a request: wait until the workers that
        borrowed its cores run their smaller shares (at most
        ``RECLAIM_WAIT_S``: a worker in a long prefill chunk reports late,
        and then the two share the cores for the rest of that chunk)."""
        deadline = asyncio.get_running_loop().time() + RECLAIM_WAIT_S
        while self._lent_out(w):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _dispatch(self, f: Flight) -> None:
        while True:
            if self.procs.closing:
                self._unpark(f)
                f.q.put_nowait(Error("the server is shutting down", 503))
                return
            if f.gone:
                self._unpark(f)
                return
            handoff = False
            if f.parked is not None:     # nothing to compute: no prefix to wait for
                w = self._pick_decode(f.gen.params.n)
            elif self._shared_blocks_pending(f):
                w = None
            else:
                handoff = self._wants_handoff(f)
                w = self._pick_prefill() if handoff else self._pick_start(f)
            if w is not None:
                break
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
        f.worker = w
        f.seen = [0] * len(f.seen)
        f.prefill_only = handoff
        # what the worker will report once it takes the request (its cached
        # prefix): until then, a request sent to a worker busy in a long
        # step (or waiting for its lent cores) is not taken for one that
        # computes the prompt's first blocks, which would hold back every
        # request sharing them (``_shared_blocks_pending``) for that step
        f.progress = self._in_pool(f)
        gen = f.gen
        if handoff:
            gen = msgspec.structs.replace(gen, handoff=True)
        elif f.parked is not None:
            gen = msgspec.structs.replace(gen, adopt=f.parked[1])
            f.progress = len(gen.prompt) - 1
        was_idle = not w.flights
        w.flights[f.gen.id] = f
        self._lend_cores()              # before the request: its prefill runs with them
        reclaim = self._reclaims.get(w.idx)
        if self.lend_cores and (was_idle or reclaim is not None):
            # one wait per worker: a request that comes to it meanwhile waits
            # for the same one, and is sent after this one (in order)
            if reclaim is None:
                reclaim = self._reclaims[w.idx] = asyncio.ensure_future(self._cores_back(w))
                reclaim.add_done_callback(functools.partial(self._reclaimed, w.idx))
            try:
                await asyncio.shield(reclaim)
            except BaseException:        # cancelled (the client left): never sent
                if w.flights.get(f.gen.id) is f:
                    del w.flights[f.gen.id]
                    self._moved()
                raise
            if f.gone or self.procs.closing or w.flights.get(f.gen.id) is not f:
                return                   # (the client left, or the worker died, meanwhile)
        w.send(gen)

    def _reclaimed(self, idx: int, task: "asyncio.Future[None]") -> None:
        if self._reclaims.get(idx) is task:
            del self._reclaims[idx]

    # ---------------------------------------------------------- interface
    def admission_error(self, prompt_tokens: int, max_tokens: int, n: int) -> Optional[str]:
        bs = self.block_size
        total = (self.procs.max_blocks or 0) - 1
        need = -(-(prompt_tokens + max_tokens) // bs) * n
        if need > total:
            return (f"the prompt ({prompt_tokens} tokens) with max_tokens={max_tokens} and n={n} "
                    f"needs {need} blocks of {bs} tokens; the pool has {total}")
        return None

    async def generate(self, prompt: list, params: SamplingParams) -> AsyncIterator:
        seed = params.seed if params.seed is not None else random.randrange(2**31)
        f = Flight(next(self._ids), list(prompt), params, seed)
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
            if not all(f.done):
                f.gone = True
                self._unpark(f)
            if not all(f.done) and f.worker is not None:
                f.worker.flights.pop(f.gen.id, None)
                self._moved()
                try:
                    f.worker.send(wire.Cancel(f.gen.id))
                except Exception:        # the worker is gone; nothing to cancel
                    pass

    def stats(self) -> dict:
        procs = self.procs
        m = procs.mgr
        if m is None:
            return {}
        # Block 0 (the null block) is always referenced and never cached:
        # leave it out. A cached block with no references sits on the free
        # list (evicted when taken), so get_stats()'s free_blocks counts it,
        # and its total_tokens_cached is the tokens of *referenced* blocks:
        # neither says what the prefix cache holds. Count the flags instead.
        # NOTE: read without the pool lock: a scrape must not hold up the
        # workers for a scan of every block, and a gauge may be a moment stale.
        # (Pool.gauges: the definitions `shmcache inspect` uses too)
        n = m.max_blocks
        g = m.pool.gauges()
        used, n_cached, free = g["blocks_used"], g["blocks_cached"], g["blocks_free"]
        held = n - 1 - free
        per_block = m.layout.block_bytes
        out = dict(blocks_total=n - 1, blocks_used=used, blocks_free=free, blocks_cached=n_cached,
                   pool_kv_bytes=held * per_block, lock_holds=g["ops"],
                   pool_prefix_hit_rate=g["prefix_hit_rate"],
                   lock_wait_max=g["lock_wait_max_s"], lock_queue=g["lock_queue"],
                   preemptions=sum(w.preemptions for w in procs.workers),
                   worker_restarts=procs.restarts, prefill_handoffs=self.handoffs,
                   workers_alive=len(procs.live()),
                   working_bytes=sum(w.working_bytes for w in procs.workers),
                   worker_running={w.idx: sum(f.gen.params.n for f in w.flights.values()
                                              if f.started) for w in procs.workers},
                   worker_blas_threads={w.idx: w.blas_threads_running for w in procs.workers
                                        if w.blas_threads_running})
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
        m = self.procs.mgr
        out = {f"l2_{k}": v for k, v in (m.l2_counters() if m is not None else {}).items()}
        up = 1
        for w in self.procs.workers:
            if w.l2 and w.running():
                up = min(up, w.l2.get("up", 1))
        out["l2_up"] = up
        return out

    # ---------------------------------------------------------- a worker's events
    def _on(self, w: WorkerProc, msg) -> None:
        """One message from worker ``w`` (``WorkerProcesses`` calls it)."""
        if isinstance(msg, wire.Step):
            for rid, sample, tok, reason, lp in msg.items:
                f = w.flights.get(rid)
                if f is None or f.done[sample]:
                    continue
                f.seen[sample] += 1
                if f.seen[sample] > f.delivered[sample]:      # not delivered before a re-run
                    f.delivered[sample] += 1
                    f.q.put_nowait(Tokens(sample, [tok], [lp] if lp is not None else []))
                    if reason:
                        f.done[sample] = True
                        f.q.put_nowait(SampleDone(sample, reason))
                if all(f.done):
                    w.flights.pop(rid, None)
                    self._moved()
        elif isinstance(msg, wire.Progress):
            f = w.flights.get(msg.id)
            if f is not None:
                f.progress = msg.stored
                self._moved()
        elif isinstance(msg, wire.Handoff):
            f = w.flights.get(msg.id)
            if f is None or not f.prefill_only:       # gone meanwhile: drop the table
                self._send_unpark(w, msg.id)
                return
            del w.flights[msg.id]
            f.worker, f.prefill_only = None, False
            f.parked, f.cached_before = (w, msg.table), msg.cached
            self.handoffs += 1
            self._moved()
            task = asyncio.get_running_loop().create_task(self._dispatch(f))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._dispatched, f=f))
        elif isinstance(msg, wire.Admitted):
            f = w.flights.get(msg.id)
            if f is None:
                return
            self._unpark(f)              # the adopter has its own fork now
            self._moved()
            # every admission (the first, a re-run after a preemption, or on
            # another worker after a death) generates from the first token
            # again: count anew, and pass on only what was not delivered
            f.seen = [0] * len(f.seen)
            if not f.started:
                f.started = True
                cached = msg.cached_tokens if f.cached_before is None else \
                    min(msg.cached_tokens, f.cached_before)
                f.q.put_nowait(Started(msg.prompt_tokens, cached, w.idx))
        elif isinstance(msg, wire.Failed):
            f = w.flights.pop(msg.id, None)
            self._moved()
            if f is not None:
                f.q.put_nowait(Error(msg.message, msg.status))
        elif isinstance(msg, wire.Load):
            w.preemptions, w.working_bytes = msg.preemptions, msg.working_bytes
            if msg.blas_threads != w.blas_threads_running:
                w.blas_threads_running = msg.blas_threads
                if self.lend_cores:
                    self._moved()        # cores given back: a larger share may go out
            if msg.l2:
                w.l2 = msg.l2
        elif isinstance(msg, wire.Ready):
            w.ready.set()
            self._moved()

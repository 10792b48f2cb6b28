"""The supervisor's worker processes: the pool they share, their lives.

:class:`WorkerProc` is one worker process as the supervisor sees it (its
pipes, its requests in flight, what it last reported); :class:`Flight` is one
request in flight. :class:`WorkerProcesses` owns the workers' lives: it
creates the pool (its layout and dtype read from the model), starts the
workers (``python -m workers.worker.main``, attached to the pool by name,
with the L2 flags when there is an L2 tier), reads what they send, restarts
one that dies (after the pool released what it held) and stops them all.

Which worker a request goes to, and what a worker's messages mean for the
requests, is the routing's (``backend.py``'s ``WorkerBackend``, which holds
a ``WorkerProcesses``): it passes in, at construction, the callbacks for one
message from a worker (``on_message``) and for a request to send again
(``redispatch``).

Liveness beyond the exit code (a heartbeat): a worker reports its load every
0.5 s from a thread of its own, even during a long prefill. A worker that
says nothing for ``stall_s`` seconds (SIGSTOPped, or hung) is taken out of
routing (its ``ready`` cleared, so ``/health`` counts it out too); silent for
``2 * stall_s`` it is killed, and then restarted as a dead worker is. If it
speaks again before that, it is routed to again.

Poison requests: a dead worker's requests are re-run on the others, each at
most ``max_reruns`` times; a request on a worker that dies once more fails
with a clear error instead of taking down worker after worker.

The pool's name (``serve-<pid>`` unless given) and its size: see
:func:`default_pool_name`, :func:`reclaim_dead_pools` and
:func:`choose_pool_blocks`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

import msgspec

import shmcache
from shmcache.system.blas import threads_from_env

from .. import wire
from ..protocol import Error, SamplingParams

if TYPE_CHECKING:
    from shmcache.manager.paged_cache import PagedCacheManager

log = logging.getLogger("shmcache.server")

DEFAULT_POOL_BYTES = 1 << 30          # the pool's K/V when --max-blocks is not given
SHM_SHARE = 0.5                       # ... and at most this share of /dev/shm's free space
MIN_POOL_BLOCKS = 64                  # the smallest pool a default size may choose
DEFAULT_STALL_S = 10.0                # a worker silent this long is out of routing (2x: killed)
DEFAULT_MAX_RERUNS = 2                # re-runs of one request after worker deaths
POOL_PREFIX = "serve-"                # the default pool names: serve-<pid>
#: OpenBLAS's threads spin after each product for 2^n cycles (n = 28 by
#: default, about 0.1 s) before they sleep, on cores that the other workers
#: and the prefill threads need; the workers' threads sleep at once (n = 4,
#: OpenBLAS's least) unless the operator set it (decision 0022)
BLAS_SPIN_ENV, BLAS_SPIN = "OPENBLAS_THREAD_TIMEOUT", "4"


class StartupCancelled(Exception):
    """SIGINT/SIGTERM arrived while the workers were loading the model (the
    app's lifespan then lets the server stop quietly: ``startup_cancelled``)."""

    startup_cancelled = True


class PoolDoesNotFit(Exception):
    """Even the smallest pool does not fit in /dev/shm's free space (the
    message says how to fix it)."""


def default_pool_name() -> str:
    """``serve-<pid>``: unique among the live servers of one PID namespace.
    Two containers with their own PID namespaces that share /dev/shm
    (``--ipc=host``) can both be pid 1: give each its own ``--pool-name``."""
    return f"{POOL_PREFIX}{os.getpid()}"


def reclaim_dead_pools(pattern: str = POOL_PREFIX + "*") -> list:
    """Removes the pools named like ours (``pattern``) whose owner is dead
    (a server killed with SIGKILL, or a zombie) and that no live process is
    attached to; returns ``[(name, why)]`` of those removed.

    The owner is the pid *and* start time the pool records, so a pool left by
    a dead server whose pid we now have (pid 1 in a container) is dead too.
    A pool of another user is never touched (it cannot be opened)."""
    from shmcache.shm import segment
    from shmcache.errors import ShmCacheError
    from shmcache.pool.inspect_pool import PoolView, cleanup
    out = []
    for name in segment.list_names():
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        try:
            with PoolView(name, require_ready=False) as v:
                if v.owner_alive():          # (a live server's: not even its lock is taken)
                    continue
            removed, why = cleanup(name)
        except (ShmCacheError, OSError):
            continue
        if removed:
            out.append((name, why))
    return out


def choose_pool_blocks(per_block: int, shm_free: int, *, budget: int = DEFAULT_POOL_BYTES,
                       share: float = SHM_SHARE, overhead: Callable[[int], int] = lambda n: 0
                       ) -> tuple:
    """The default pool size: ``(max_blocks, why)``.

    As many blocks as fit in ``budget`` bytes of K/V and in ``share`` of
    /dev/shm's free space (``shm_free``), metadata (``overhead(blocks)``)
    included, and at most 2**20.

    Raises:
        PoolDoesNotFit: not even :data:`MIN_POOL_BLOCKS` fit.
    """
    room = int(shm_free * share)
    limit, why = (budget, f"{budget >> 20} MiB of K/V, the default") if budget <= room else (
        room, f"{share:.0%} of /dev/shm's {shm_free / 2**20:.0f} MiB free")
    n = min(1 << 20, limit // per_block)
    while n >= MIN_POOL_BLOCKS and n * per_block + overhead(n) > limit:
        n = int(n * 0.95)
    if n < MIN_POOL_BLOCKS:
        need = MIN_POOL_BLOCKS * per_block + overhead(MIN_POOL_BLOCKS)
        raise PoolDoesNotFit(
            f"/dev/shm has {shm_free / 2**20:.1f} MiB free, and the smallest pool for this "
            f"model ({MIN_POOL_BLOCKS} blocks) needs {need / 2**20:.1f} MiB (half the free "
            f"space at most); give /dev/shm more room (docker run --shm-size=1g; "
            f"shmcache cleanup removes dead pools) or choose the size with --max-blocks N")
    return n, why



def blas_threads_per_worker(workers: int) -> int:
    """BLAS threads for each of ``workers`` processes: this process's CPUs
    divided among them, at least 1."""
    return max(1, cpus_available() // max(1, workers))


#: the most prefill threads a worker gets by default
PREFILL_THREADS_MAX = 8


def prefill_threads_per_worker(workers: int) -> int:
    """The default ``--prefill-threads`` of each of ``workers`` processes:
    this process's CPUs, at most PREFILL_THREADS_MAX, where each worker has
    2 or more of them; else 1 (off). A worker's prefill threads run beyond
    its share of the cores, on idle ones mostly: on 16 cores with 8 workers
    8 threads gave 1.11-1.14x the throughput of 1; on 2 cores with 2 they
    took the core the other worker decodes on (inter-token p99 1.8-2.6x,
    throughput 0.98-1.08x; decision 0021)."""
    return min(PREFILL_THREADS_MAX, cpus_available()) if two_cpus_a_worker(workers) else 1


def lend_cores_by_default(workers: int) -> bool:
    """The default of ``--lend-cores`` for ``workers`` processes: on where
    each worker has 2 or more of this process's CPUs (the rule of
    :func:`prefill_threads_per_worker`), else off. On 16 cores with 8
    workers, with the workers' OpenBLAS threads sleeping at once after a
    product, it gave 1.06-1.38x the throughput with every chat session in
    flight and 1.05-1.07x on the 24-layer model; on 2 cores with 2 workers
    1.05-1.15x, but later chat turns waited 1.2-1.6x as long for their first
    token (decision 0015)."""
    return two_cpus_a_worker(workers)


def two_cpus_a_worker(workers: int) -> bool:
    """Whether each of ``workers`` processes has 2 or more of this
    process's CPUs: the rule of the defaults above."""
    return cpus_available() >= 2 * max(1, workers)


def pinned_cpus(workers: int) -> Optional[list]:
    """``--pin-cores``: for each of ``workers`` processes, CPUs of its own,
    its share (this process's CPUs divided among them, in order); None where
    the workers outnumber the CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    each = len(cpus) // max(1, workers)
    if each < 1:
        return None
    return [cpus[i * each:(i + 1) * each] for i in range(workers)]


def cpus_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def core_shares(workers: list, cpus: int, base: int) -> dict:
    """BLAS threads for each worker, the idle workers' cores lent out.

    ``workers``: ``(idx, busy, decoding)`` for each live worker (``busy``: it
    has requests; ``decoding``: it runs rows). Every worker keeps its own
    share, ``base`` (``blas_threads_per_worker``); the cores of the idle
    ones are shared out among the decoding workers, or among the busy ones
    when none decodes. Returns ``{idx: threads}``.

    Why lend: a worker computes with its own BLAS threads only, so with
    requests on a few workers the other workers' cores wait. N separate
    servers cannot lend each other cores; one supervisor can. An idle
    worker makes no BLAS calls, so its share is free to lend. Decoding
    workers get them first: a CPU decode step is a few thin matrix products
    per layer over every weight, which more threads speed up (on 16 cores,
    4 rows: 66 ms a step on 2 threads, 52 on 4), while a prefill is bound by
    compute and scales with processes more than threads (a process
    prefills 375 tok/s on 2 threads, 419 on 4; decision 0019's table).
    With no decoding worker (a long prompt on an idle server) the busy ones
    take them: alone, a prompt gains from them (a 460-token prompt computed
    while the other workers waited for its blocks: 0.91 s on 16 threads,
    1.36-1.38 s on 2; 16 cores, `realistic:6`, the serving benchmark's step
    logs).

    INVARIANT: the sum over busy workers is at most ``cpus`` (or ``base``
    each, where the workers outnumber the CPUs) once every worker runs what
    it was told. The supervisor keeps it while the told
    counts change (``WorkerBackend._lend_cores``): a smaller share is sent
    at once, a larger one only when the cores it takes are free, and a
    request for an idle worker waits (briefly) until the workers that
    borrowed its cores have given them back: an oversubscribed core slows
    every thread of a BLAS call that runs on it."""
    busy = [i for i, b, _ in workers if b]
    takers = [i for i, b, d in workers if b and d] or busy
    free = cpus - base * len(busy)
    extra = free // len(takers) if takers and free > 0 else 0
    return {i: base + (extra if i in takers else 0) for i, _, _ in workers}


MIN_WORKING_BYTES = 256 << 20


def default_working_bytes(workers: int) -> int:
    """A worker's default ``--max-working-bytes``: half of this machine's
    memory divided among ``workers`` (the other half is for the weights, the
    pool, the server and everything else), at least 256 MiB."""
    import psutil
    return max(MIN_WORKING_BYTES, psutil.virtual_memory().total // 2 // max(1, workers))


class Flight:
    """One request in flight: where it runs, what was delivered.

    The routing (``backend.py``) creates it, sends it to a worker and turns
    that worker's messages into its events (``q``); :class:`WorkerProcesses`
    ends it with an error, or hands it back to be re-run, when its worker dies
    or the server stops."""

    def __init__(self, rid: int, prompt: list, params: SamplingParams, seed: int) -> None:
        self.gen = wire.Gen(rid, prompt, params, seed)
        self.q: asyncio.Queue = asyncio.Queue()
        self.worker: Optional[WorkerProc] = None
        self.started = False
        self.delivered = [0] * params.n        # tokens delivered per sample
        self.seen = [0] * params.n             # tokens seen in the current run
        self.progress = 0                      # prompt tokens in the pool (this run's prefill)
        self.done = [False] * params.n
        self.reruns = 0                        # times re-run after its worker died
        self.logged_at: Optional[int] = None   # seconds waited at its last "long prefill" line
        # a prefill handed over (backend.py, --handoff-tokens): on its worker
        # for prefill only; then the worker keeping its table, and the table,
        # until the decoding worker has adopted it; the cached tokens its
        # prefill found (what the client is told, not the adopter's count)
        self.prefill_only = False
        self.parked: Optional[tuple[WorkerProc, str]] = None
        self.cached_before: Optional[int] = None
        self.gone = False                      # its client left: never dispatched again


class WorkerProc:
    """One worker process: its pipes, its requests in flight, its reports."""

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.ready = asyncio.Event()
        self.flights: dict[int, Flight] = {}
        self.load = 0
        self.preemptions = 0
        self.working_bytes = 0
        self.l2: dict = {}                 # its L2 counters and "up", as last reported
        self.blas_threads = 0              # BLAS threads it was started with or last told
        self.blas_threads_running = 0      # ... and the ones it last reported running
        self.reader: Optional[asyncio.Task] = None
        self.enc = msgspec.msgpack.Encoder()
        self.last_heard: Optional[float] = None   # monotonic; None until it is ready
        self.stalled = False                       # silent too long: out of routing

    def send(self, msg) -> None:
        body = self.enc.encode(msg)
        self.proc.stdin.write(len(body).to_bytes(4, "little") + body)  # type: ignore[union-attr]

    def running(self) -> bool:
        """Started, and not exited (it may still be loading the model)."""
        return self.proc is not None and self.proc.returncode is None

    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1


class WorkerProcesses:
    """The worker processes' lives over one pool: creating the pool (its
    layout and dtype read from the model), starting the workers, reading what
    they send, watching their heartbeat, restarting one that dies (after the
    pool released what it held) and re-running its requests, stopping them all.

    Which worker a request goes to, and what a message means for a request,
    is its owner's: each message goes to ``on_message(worker, message)``
    (after the heartbeat saw it), and a dead worker's request to
    ``redispatch(flight)`` (awaited), unless it was re-run ``max_reruns``
    times already.

    Args:
        path: the mlx-lm model directory.
        n_workers: worker processes.
        block_size: tokens per block.
        max_blocks: pool blocks (None: :func:`choose_pool_blocks` at ``prepare``).
        max_batch, prefill_step, decoding_prefill_step, prefill_threads:
            each worker's (``--max-batch``, ``--prefill-step``,
            ``--decoding-prefill-step``, ``--prefill-threads``; None: its
            default; for ``prefill_threads``, :func:`prefill_threads_per_worker`).
        pool_name: the pool's name.
        on_message: called with each message a worker sends.
        redispatch: awaited with each request of a dead worker to run again.
        startup_cancelled: polled while the workers load the model; True
            stops ``start`` (:class:`StartupCancelled`).
        l2_url: a Redis URL: the L2 tier (None: L1 only).
        cluster_secret: the secret of the pools that share L2 entries (None:
            each worker uses the pool's own).
        l2_timeout, l2_retry, l2_ttl: the workers' L2 flags (None: theirs).
        stall_s: a worker silent this long leaves the routing; twice, it is killed.
        max_reruns: re-runs of one request after worker deaths.
        max_working_bytes: each worker's working K/V bytes (None:
            :func:`default_working_bytes`).
    """

    def __init__(self, path: Path, n_workers: int, *, block_size: int,
                 max_blocks: Optional[int], max_batch: int, prefill_step: int, pool_name: str,
                 decoding_prefill_step: Optional[int] = None,
                 prefill_threads: Optional[int] = None,
                 on_message: Callable[[WorkerProc, Any], None],
                 redispatch: Callable[[Flight], Awaitable[None]],
                 startup_cancelled: Callable[[], bool] = lambda: False,
                 l2_url: Optional[str] = None, cluster_secret: Optional[bytes] = None,
                 l2_timeout: Optional[float] = None, l2_retry: Optional[float] = None,
                 l2_ttl: Optional[int] = None, stall_s: float = DEFAULT_STALL_S,
                 max_reruns: int = DEFAULT_MAX_RERUNS,
                 max_working_bytes: Optional[int] = None, pin_cores: bool = False) -> None:
        self.path = path
        self.n_workers = n_workers
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_batch = max_batch
        self.prefill_step = prefill_step
        self.decoding_prefill_step = decoding_prefill_step
        self.prefill_threads = prefill_threads or prefill_threads_per_worker(n_workers)
        self.pool_name = pool_name
        self.on_message = on_message
        self.redispatch = redispatch
        self.startup_cancelled = startup_cancelled
        self.l2_url = l2_url
        self.l2_timeout, self.l2_retry, self.l2_ttl = l2_timeout, l2_retry, l2_ttl
        self.l2_secret = cluster_secret
        self.stall_s = stall_s
        self.max_reruns = max_reruns
        self.max_working_bytes = max_working_bytes
        self.cpus = cpus_available()
        self.blas_share = blas_threads_per_worker(n_workers)   # each worker's own BLAS threads
        # --pin-cores: the CPUs each worker (by index) runs on (None: anywhere)
        self.worker_cpus = pinned_cpus(n_workers) if pin_cores else None
        if pin_cores and self.worker_cpus is None:
            log.warning("--pin-cores: %d workers outnumber the %d CPUs this process may use; "
                        "the workers are not pinned", n_workers, self.cpus)
        self.mgr: Optional[PagedCacheManager] = None   # the pool, from prepare() to close()
        self.layout: Optional[dict] = None             # its layout, as pool_layout read it
        self.context_length: Optional[int] = None      # the model's, from its config (None: unknown)
        self.l2_model_id: Optional[str] = None
        self.workers: list[WorkerProc] = []
        self.restarts = 0
        self.closing = False            # stopping: no request is routed, no worker restarted
        self.started = False            # every worker was ready once: restart the dead ones
        self._watchdog: Optional[asyncio.Task] = None

    def working_bytes_limit(self) -> int:
        """Each worker's limit on working K/V buffer bytes (``--max-working-bytes``)."""
        return self.max_working_bytes or default_working_bytes(self.n_workers)

    def live(self) -> list[WorkerProc]:
        """The workers that are ready (not stalled) and running: the ones to route to."""
        return [w for w in self.workers if w.ready.is_set() and w.running()]

    # ------------------------------------------------------------ lifecycle
    def prepare(self) -> None:
        """Reads the model's layout and creates the pool (``start`` does it if
        not done yet). Call it before serving to fail early: a model that
        cannot be loaded or served raises ValueError, FileNotFoundError or
        NotPoolableError; a pool that does not fit, PoolDoesNotFit or
        InsufficientSharedMemoryError."""
        if self.mgr is None:
            # On this (the main) thread, not in an executor: pool_layout runs
            # the model once, which fills MLX's *thread-local* compile cache
            # (swiglu, ...). An executor thread destroys that cache at its
            # exit, after Python has let it go, and the destructor takes the
            # GIL: racing the interpreter's finalization at shutdown, that
            # aborted the server ("terminate called without an active
            # exception", exit 134).
            self._create_pool()

    async def start(self) -> None:
        self.prepare()
        self.workers = [WorkerProc(i) for i in range(self.n_workers)]
        for w in self.workers:
            await self._spawn(w)
        log.info("loading the model in %d workers...", self.n_workers)
        while not all(w.ready.is_set() for w in self.workers):
            await asyncio.sleep(0.05)
            if self.startup_cancelled():
                raise StartupCancelled("stopped while the workers were loading the model")
            dead = [w for w in self.workers if not w.running()]
            if dead:
                rc = dead[0].proc.returncode if dead[0].proc is not None else None
                raise RuntimeError(f"worker {dead[0].idx} exited with {rc} "
                                   f"while loading the model (its error is above)")
        self.started = True
        self._watchdog = asyncio.create_task(self._watch())
        log.info("all %d workers ready (pool %s: %d blocks of %d tokens)", self.n_workers,
                 self.pool_name, self.max_blocks, self.block_size)

    def _create_pool(self) -> None:
        import mlx.core as mx  # noqa: F401  (after shmcache: the fast BLAS)
        from mlx_lm.utils import load_model

        from shmcache.shm import layout as L
        from shmcache.shm import segment
        from shmcache.models.mlx_lm import pool_layout
        model, config = load_model(self.path, lazy=True)
        lay = pool_layout(model)
        del model
        ctx = config.get("max_position_embeddings") if isinstance(config, dict) else None
        self.context_length = int(ctx) if isinstance(ctx, int) and ctx > 0 else None
        per_block = L.kv_block_bytes(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"],
                                     self.block_size, lay["dtype"])
        max_slots = max(64, 4 * self.n_workers)
        max_tables = max(1024, 4 * self.max_batch * self.n_workers)

        def size(n: int) -> int:
            return L.compute_layout(self.block_size, n, True, lay["num_layers"],
                                    lay["num_kv_heads"], lay["head_dim"], lay["dtype"],
                                    max_slots, max_tables, 16 * n).total_size
        if self.max_blocks is None:
            free = segment.free_bytes(segment.SHM_DIR)
            self.max_blocks, why = choose_pool_blocks(
                per_block, free, overhead=lambda n: size(n) - n * per_block)
            log.info("pool: %d blocks of %d tokens, %.0f MiB (%s; --max-blocks sets it)",
                     self.max_blocks, self.block_size, size(self.max_blocks) / 2**20, why)
        else:
            holds = (self.max_blocks - 1) * self.block_size
            if self.context_length and holds < self.context_length:
                log.warning("pool: --max-blocks %d holds %d tokens, less than the model's "
                            "context of %d: longer requests (prompt + max_tokens) are refused "
                            "with a 400", self.max_blocks, holds, self.context_length)
        self.mgr = shmcache.create_pool(
            self.pool_name, block_size=self.block_size, max_blocks=self.max_blocks,
            max_slots=max_slots, max_refs=16 * self.max_blocks, max_tables=max_tables, **lay)
        self.layout = lay
        if self.l2_url:
            self._start_l2(self.l2_url)

    def _start_l2(self, url: str) -> None:
        from shmcache import l2
        self.l2_model_id = l2.model_identity(self.path)
        client = l2.connect(url, 1.0)               # (raises without redis-py)
        try:
            ok = bool(client.ping())
        except Exception as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        finally:
            client.close()
        log.info("L2: %s (%s), %s secret, model %s", l2.redact(url),
                 "reachable" if ok else f"not reachable now ({why}); the workers retry",
                 "the cluster" if self.l2_secret is not None else "this pool's own",
                 self.l2_model_id)

    async def _spawn(self, w: WorkerProc) -> None:
        w.ready.clear()
        env = dict(os.environ)
        # the CPUs shared out among the workers: each one's BLAS gets its
        # share as threads (at least 1), unless the operator chose
        if not env.get("SHMCACHE_BLAS_THREADS", "").strip():
            env["SHMCACHE_BLAS_THREADS"] = str(self.blas_share)
        # what the worker will run: the operator's value, or 1 where that is
        # not a positive integer (shmcache.system.blas warns, there)
        w.blas_threads = threads_from_env(env) or 1
        if not env.get(BLAS_SPIN_ENV, "").strip():
            env[BLAS_SPIN_ENV] = BLAS_SPIN
        w.blas_threads_running = 0                 # (until the new process reports)
        env.pop(wire.WORKER_CPUS_ENV, None)
        if self.worker_cpus is not None:           # a replacement gets the same CPUs
            env[wire.WORKER_CPUS_ENV] = ",".join(str(c) for c in self.worker_cpus[w.idx])
        extra: list[str] = []
        if self.l2_url:
            if self.l2_secret is not None:
                env[wire.L2_SECRET_ENV] = self.l2_secret.hex()
            extra = ["--l2", self.l2_url, "--l2-model-id", str(self.l2_model_id)]
            for flag, v in (("--l2-timeout", self.l2_timeout), ("--l2-retry", self.l2_retry),
                            ("--l2-ttl", self.l2_ttl)):
                if v is not None:
                    extra += [flag, str(v)]
        if self.decoding_prefill_step is not None:
            extra += ["--decoding-prefill-step", str(self.decoding_prefill_step)]
        extra += ["--prefill-threads", str(self.prefill_threads)]
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "workers.worker.main", "--pool", self.pool_name,
            "--model", str(self.path), "--id", str(w.idx), "--max-batch", str(self.max_batch),
            "--prefill-step", str(self.prefill_step),
            "--max-working-bytes", str(self.working_bytes_limit()), *extra,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            start_new_session=True)          # Ctrl-C reaches the server, which stops them
        w.reader = asyncio.create_task(self._read(w, w.proc))

    def fail_in_flight(self, message: str = "the server is shutting down",
                       status: int = 503) -> int:
        """Ends every request in flight with an error (before the HTTP server
        cancels them at shutdown, so that each client is told why); returns
        how many. New requests are refused from now on."""
        self.closing = True
        n = 0
        for w in self.workers:
            for f in list(w.flights.values()):
                f.q.put_nowait(Error(message, status))
                n += 1
        return n

    async def close(self) -> None:
        self.closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for w in self.workers:
            if w.proc and w.proc.returncode is None and not w.ready.is_set() \
                    and not self.started:
                w.proc.terminate()            # still loading the model: stop it now
            if w.proc and w.proc.returncode is None:
                try:
                    w.send(wire.Stop())
                    w.proc.stdin.close()      # type: ignore[union-attr]  # (a pipe)
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

    def remove_unserved_pool(self) -> None:
        """Removes the pool if ``prepare`` created it but the workers never
        all started (serving failed or was stopped before it began)."""
        if self.mgr is not None and not self.started:
            self.mgr.destroy()
            self.mgr = None

    # ---------------------------------------------------------- a worker's pipe
    async def _read(self, w: WorkerProc, proc: asyncio.subprocess.Process) -> None:
        dec = wire.from_worker
        out = proc.stdout
        assert out is not None                # (spawned with stdout=PIPE)
        try:
            while True:
                head = await out.readexactly(4)
                body = await out.readexactly(int.from_bytes(head, "little"))
                msg = dec.decode(body)
                if w.proc is proc:
                    self._heard(w, isinstance(msg, wire.Ready))
                self.on_message(w, msg)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        await proc.wait()
        if not self.closing and self.started:
            await self._died(w, proc.returncode)

    # ------------------------------------------------------------ heartbeat
    def _heard(self, w: WorkerProc, ready: bool) -> None:
        if ready or w.last_heard is not None:
            w.last_heard = time.monotonic()
        if w.stalled:
            w.stalled = False
            w.ready.set()
            log.warning("worker %d (pid %d) speaks again: routed to again", w.idx, w.pid())

    async def _watch(self) -> None:
        """Every ``stall_s / 4`` (at most 1 s): a worker silent for ``stall_s``
        leaves the routing, one silent for ``2 * stall_s`` is killed (its
        reader then restarts it and re-runs its requests). Logs the requests
        waiting long for their first token (a long prefill)."""
        waiting_logged: dict = {}
        while not self.closing:
            await asyncio.sleep(min(1.0, self.stall_s / 4))
            now = time.monotonic()
            for w in self.workers:
                if w.proc is None or w.proc.returncode is not None or w.last_heard is None:
                    continue
                silent = now - w.last_heard
                if silent > 2 * self.stall_s:
                    log.warning("worker %d (pid %d) silent for %.1f s: killed, to be restarted",
                                w.idx, w.proc.pid, silent)
                    w.last_heard = None
                    try:
                        w.proc.kill()
                    except ProcessLookupError:
                        pass
                elif silent > self.stall_s and not w.stalled:
                    w.stalled = True
                    w.ready.clear()
                    log.warning("worker %d (pid %d) silent for %.1f s (stopped or hung): no "
                                "new requests go to it; killed at %.0f s", w.idx, w.proc.pid,
                                silent, 2 * self.stall_s)
                for f in w.flights.values():
                    if f.started:
                        continue
                    t0 = waiting_logged.setdefault(f.gen.id, now)
                    waited = now - t0
                    if waited >= 5 and int(waited) % 5 == 0 and int(waited) != f.logged_at:
                        f.logged_at = int(waited)
                        # progress: the prompt tokens in the pool so far (the
                        # worker's Progress after its cache hit and each chunk)
                        log.info("request %d: prefill %d of %d prompt tokens, no first "
                                 "token after %d s on worker %d (a long prefill, or a queue)",
                                 f.gen.id, f.progress, len(f.gen.prompt), int(waited), w.idx)
            live = {f.gen.id for w in self.workers for f in w.flights.values()}
            for rid in [r for r in waiting_logged if r not in live]:
                del waiting_logged[rid]

    async def _died(self, w: WorkerProc, rc: Optional[int]) -> None:
        flights = list(w.flights.values())
        w.flights.clear()
        w.ready.clear()
        w.last_heard, w.stalled = None, False
        w.l2 = {}                          # (its counters are the pool's: they stay)
        log.warning("worker %d (pid %d) died (exit %s); re-running its %d requests",
                    w.idx, w.pid(), rc if rc is None or rc >= 0 else signal.Signals(-rc).name,
                    len(flights))
        if self.mgr is not None:
            self.mgr.reclaim_dead()
        self.restarts += 1
        await self._spawn(w)
        for f in flights:
            f.reruns += 1
            if f.reruns > self.max_reruns:
                log.warning("request %d was on %d workers that died: not run again",
                            f.gen.id, f.reruns)
                f.q.put_nowait(Error(
                    f"the request was running on {f.reruns} worker processes that died "
                    f"(the last exited with {rc}); it is not run again, in case it is what "
                    f"kills them", 500))
                continue
            await self.redispatch(f)

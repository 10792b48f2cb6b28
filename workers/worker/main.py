"""A worker process of ``shmcache serve``: ``python -m workers.worker.main``.

It attaches to the pool by name, loads the model with mlx-lm, says
:class:`~workers.wire.Ready`, and then runs its
:class:`~workers.worker.engine.Engine`: messages from the supervisor arrive
on stdin (read by a thread into a queue) and are taken between steps; events
go back on a private copy of stdout. The worker exits when stdin closes (the
supervisor is gone) or on :class:`~workers.wire.Stop`.

Heartbeat: the main loop reports its :class:`~workers.wire.Load`
every 0.5 s between steps; a thread repeats the last report when the main
loop has sent none for 0.5 s (a long prefill is one step), so a worker that
says nothing at all is stopped or hung, and the supervisor acts on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import time

from ..wire import WORKER_CPUS_ENV  # (msgspec only: no BLAS, no mlx)


def _pin() -> None:
    """With ``--pin-cores``, run on the CPUs the supervisor gave: first,
    before the BLAS and MLX start their threads, which inherit them."""
    cpus = os.environ.get(WORKER_CPUS_ENV, "").strip()
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])


_pin()

import shmcache  # noqa: E402  (first after _pin: binds the fast BLAS before mlx loads)
import shmcache.system.blas  # noqa: E402

from .. import wire  # noqa: E402
from ..wire import L2_SECRET_ENV  # noqa: E402


def _reader(q: queue.Queue) -> None:
    while True:
        body = wire.read_frame(0)
        if body is None:
            q.put(None)
            return
        q.put(wire.to_worker.decode(body))


HEARTBEAT_S = 0.5


def _heartbeat(writer, last: list, stop: threading.Event, lock: threading.Lock) -> None:
    """Resends ``last[0]`` (the latest Load) when nothing was sent for
    HEARTBEAT_S; ``last[1]`` is when the main loop last sent one. Under
    ``lock``, which the main loop holds while it builds and sends a new one:
    a resend never follows a newer report (its thread count would undo it)."""
    while not stop.wait(HEARTBEAT_S / 2):
        with lock:
            if time.monotonic() - last[1] < HEARTBEAT_S:
                continue
            try:
                writer.send(last[0])
            except OSError:                # the supervisor is gone
                return
            last[1] = time.monotonic()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.worker.main")
    ap.add_argument("--pool", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--id", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--decoding-prefill-step", type=int, default=None,
                    help="the prefill tokens per step while rows run (default: --prefill-step)")
    ap.add_argument("--prefill-threads", type=int, default=1,
                    help="threads for a prefill's softmax and SiLU (prefill_threads; the "
                         "supervisor passes its choice; 1: off)")
    ap.add_argument("--max-working-bytes", type=int, default=None,
                    help="the most bytes of working K/V buffers (Engine's max_working_bytes)")
    ap.add_argument("--l2", default=None, help="the L2's Redis URL")
    ap.add_argument("--l2-model-id", default=None, help="the model's identity in L2 keys")
    ap.add_argument("--l2-timeout", type=float, default=None)
    ap.add_argument("--l2-retry", type=float, default=None)
    ap.add_argument("--l2-ttl", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SHMCACHE_LOG_LEVEL", "WARNING").upper(),
                        format=f"worker {args.id}: %(message)s")
    out = os.dup(1)                 # the message stream
    os.dup2(2, 1)                   # anything printed goes to stderr
    writer = wire.Writer(out)

    from shmcache.models.mlx_lm import check_pool_matches, pool_layout
    from shmcache.models.weights import load_model_shared
    from .engine import Engine

    model, tokenizer = load_model_shared(args.model)   # one copy of the weights for all workers
    from . import prefill_threads
    threads = prefill_threads.install(model, args.prefill_threads)
    logging.getLogger(__name__).info("prefill threads: %d", threads)
    l2 = {}
    if args.l2:
        # the cluster secret comes in the environment (a command line is
        # public); without one the pool's own secret keeps L2 to this pool
        secret = os.environ.pop(L2_SECRET_ENV, None)
        options = {k: v for k, v in (("timeout", args.l2_timeout), ("retry_s", args.l2_retry),
                                     ("ttl", args.l2_ttl)) if v is not None}
        l2 = dict(l2=args.l2, l2_model=args.l2_model_id or args.model,
                  cluster_secret=bytes.fromhex(secret) if secret else None, l2_options=options)
    mgr = shmcache.attach(args.pool, **l2)
    try:
        check_pool_matches(mgr, pool_layout(model))
    except BaseException:
        mgr.close()
        raise

    def emit(kind, payload):
        if kind == "admitted":
            writer.send(wire.Admitted(*payload))
        elif kind == "progress":
            writer.send(wire.Progress(*payload))
        elif kind == "step":
            writer.send(wire.Step(payload))
        elif kind == "handoff":
            writer.send(wire.Handoff(*payload))
        elif kind == "failed":
            writer.send(wire.Failed(*payload))

    engine = Engine(mgr, model, tokenizer.eos_token_ids, emit, args.id, args.max_batch,
                    args.prefill_step, args.max_working_bytes, args.decoding_prefill_step)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(q,), daemon=True).start()
    writer.send(wire.Ready(args.id, os.getpid()))
    last_load = 0.0
    beat = [wire.Load(args.id, 0, 0, 0, 0, {}), time.monotonic()]
    beat_stop = threading.Event()
    beat_lock = threading.Lock()

    def report() -> None:
        """Send this worker's counters (``Load``) now."""
        nonlocal last_load
        with beat_lock:
            last_load = time.monotonic()
            beat[0] = wire.Load(args.id, len(engine.rows), len(engine.waiting),
                                engine.preemptions, engine.working_bytes(),
                                mgr.l2.stats() if mgr.l2 is not None else {},
                                shmcache.system.blas.threads() or 0)
            writer.send(beat[0])
            beat[1] = last_load

    threading.Thread(target=_heartbeat, args=(writer, beat, beat_stop, beat_lock), daemon=True).start()
    try:
        while True:
            try:
                if not engine.busy:
                    msg = q.get(timeout=0.5)
                elif engine.waiting_on_l2:         # an L2 lookup in flight, nothing to decode
                    msg = q.get(timeout=0.002)
                else:
                    msg = q.get_nowait()
            except queue.Empty:
                msg = False
            told = False
            while msg is not False:
                if msg is None or isinstance(msg, wire.Stop):
                    return 0
                if isinstance(msg, wire.Gen):
                    engine.submit(msg)
                elif isinstance(msg, wire.Cancel):
                    engine.cancel(msg.id)
                elif isinstance(msg, wire.Unpark):
                    engine.unpark(msg.id)
                elif isinstance(msg, wire.Threads):
                    shmcache.system.blas.use_fast_blas(threads=msg.n)   # from this step on
                    told = True
                try:
                    msg = q.get_nowait()
                except queue.Empty:
                    msg = False
            if told:
                report()                 # before the step: the supervisor lends the
                #                          cores given back only once they are
            engine.step()
            if time.monotonic() - last_load > 0.5:
                report()
    except BrokenPipeError:
        return 0
    finally:
        beat_stop.set()
        engine.close()
        mgr.close()                 # (stops its L2 tier first: up to 1 s of writes)


if __name__ == "__main__":
    sys.exit(main())

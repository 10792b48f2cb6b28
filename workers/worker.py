"""A generation worker: attaches to the pool by name and serves requests.

Per request: acquire the longest cached prefix any worker published (one
atomic lookup-and-reference), prefill the rest one block per chunk (so every
chunk starts at the same absolute block boundary whoever computes it, and
the stored K/V are bit-identical), publish each full block only after all
its layers are written, fork the table for ``n > 1`` samples, decode token
by token, and delete the tables at the end.

A worker interleaves up to ``max_running`` requests, one step each in turn.
When the pool runs out of blocks (cached free blocks are reused first, by
the pool itself) it preempts its newest request: frees its tables and puts
it back in its queue, to be recomputed from scratch later. Sampling draws
from a generator seeded per (request seed, sample), so the tokens never
depend on the worker, the cache, or preemptions.
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

import shmcache
from shmcache import OutOfBlocksError

from .model import Model, ModelConfig, decode_step, sample
from .protocol import Channel, Done, Failed, Ready, Request, Shutdown, ToWorker
from .seam import PagedKVSeam


@dataclass
class _Running:
    req: Request
    t_arrival: float
    preemptions: int = 0
    attempt: int = 0
    tables: list = field(default_factory=list)
    seams: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    rngs: list = field(default_factory=list)
    pos: int = 0
    published: int = 0
    cached_tokens: int = 0
    ttft: float = -1.0


class Worker:
    """Serves requests over one manager attached to the pool."""

    def __init__(self, worker_id: int, mgr, model: Model, max_running: int = 3) -> None:
        self.id = worker_id
        self.mgr = mgr
        self.model = model
        self.bs = mgr.block_size
        self.max_running = max_running
        self.waiting: deque = deque()
        self.running: list = []
        self.preempt_counts: dict = {}
        self.arrivals: dict = {}
        self._attempts = 0
        self._pressure = False

    # ---------------------------------------------------------------- lifecycle
    def submit(self, req: Request) -> None:
        self.arrivals.setdefault(req.id, time.perf_counter())
        self.waiting.append(req)

    def _extra(self, req: Request):
        return (req.salt,) if req.salt else None

    def _rid(self, st: _Running, j: int) -> str:
        return f"r{st.req.id}.w{self.id}.a{st.attempt}.s{j}"

    def _begin(self, st: _Running) -> None:
        """Create the request's table and take the longest cached prefix.

        Done when its prefill starts (not on admission), so it sees every
        block published by the requests prefilled before it.
        """
        self._attempts += 1
        st.attempt = self._attempts
        req, mgr = st.req, self.mgr
        table = mgr.create_block_table(self._rid(st, 0))
        st.tables.append(table)
        try:
            # Leave the last prompt token to compute: its logits start decoding.
            blocks, cached = mgr.acquire_computed_blocks(req.prompt[:-1], self._extra(req))
            for b in blocks:
                mgr.add_block_to_table(table, b, self.bs)
        except BaseException:
            self._release(st)
            raise
        st.cached_tokens = cached
        st.pos = cached
        st.published = cached // self.bs
        st.seams.append(PagedKVSeam(mgr, table, cached))

    def _release(self, st: _Running) -> None:
        for t in st.tables:
            try:
                self.mgr.delete_block_table(t.request_id)
            except KeyError:
                pass
        st.tables.clear()
        st.seams.clear()

    def _preempt_newest(self) -> None:
        st = self.running.pop()
        self._release(st)
        self.preempt_counts[st.req.id] = self.preempt_counts.get(st.req.id, 0) + 1
        self.waiting.appendleft(st.req)

    # --------------------------------------------------------------------- steps
    def _prefill_step(self, st: _Running) -> None:
        req, bs = st.req, self.bs
        end = min(len(req.prompt), (st.pos // bs + 1) * bs)
        chunk = req.prompt[st.pos:end]
        seam = st.seams[0]
        logits = self.model(mx.array([chunk], dtype=mx.int32), seam, last_only=True)[0, -1]  # (vocab,)
        mx.eval(logits)
        seam.advance(len(chunk))
        st.pos = end
        full = end // bs
        if full > st.published and self.mgr.enable_caching:
            # Every layer of these blocks is written: now others may use them.
            self.mgr.cache_full_blocks(st.tables[0].block_ids, req.prompt, st.published,
                                       full, self._extra(req))
            st.published = full
        if end == len(req.prompt):
            self._first_tokens(st, logits)

    def _first_tokens(self, st: _Running, logits) -> None:
        req = st.req
        for j in range(1, req.n):
            t = self.mgr.fork_block_table(st.tables[0], self._rid(st, j))
            st.tables.append(t)
            st.seams.append(st.seams[0].fork(t))
        st.rngs = [np.random.default_rng([req.seed, req.id, j]) for j in range(req.n)]
        st.outputs = [[sample(logits, req.temperature, st.rngs[j])] for j in range(req.n)]
        st.ttft = time.perf_counter() - st.t_arrival

    def _decode_step(self, st: _Running) -> None:
        req = st.req
        for j, out in enumerate(st.outputs):
            if len(out) >= req.max_new_tokens:
                continue
            logits = decode_step(self.model, out[-1], st.seams[j])
            out.append(sample(logits, req.temperature, st.rngs[j]))

    def _finished(self, st: _Running) -> bool:
        return bool(st.outputs) and all(len(o) >= st.req.max_new_tokens for o in st.outputs)

    def step(self) -> list:
        """Admit waiting requests; run one prefill chunk (one request prefills
        at a time, so the next one finds its prefix cached) and one decode
        step of every decoding request. Returns the Done messages."""
        if not self.running:
            self._pressure = False
        # NOTE: after running out of blocks, admit nothing new until a request
        # finishes; otherwise the newcomer takes the blocks the preempted
        # request's survivors need, is preempted in turn, and so on forever.
        while self.waiting and len(self.running) < self.max_running and not self._pressure:
            req = self.waiting.popleft()
            self.running.append(_Running(req, self.arrivals[req.id],
                                         self.preempt_counts.get(req.id, 0)))
        prefilling = next((st for st in self.running if not st.outputs), None)
        todo = [st for st in self.running if st.outputs]
        if prefilling is not None:
            todo.insert(0, prefilling)
        done = []
        for st in todo:
            if st not in self.running:
                continue  # preempted during this round
            try:
                if not st.outputs:
                    if not st.tables:
                        self._begin(st)
                    self._prefill_step(st)
                else:
                    self._decode_step(st)
            except (OutOfBlocksError, shmcache.CapacityError):
                self._out_of_blocks()
                continue
            if self._finished(st):
                self.running.remove(st)
                self._release(st)
                done.append(Done(st.req.id, self.id, len(st.req.prompt), st.cached_tokens,
                                 st.outputs, st.ttft, st.preemptions))
                self.arrivals.pop(st.req.id, None)
                self._pressure = False
        return done

    def _out_of_blocks(self) -> None:
        self._pressure = True
        alone = len(self.running) == 1
        self._preempt_newest()
        if alone:
            # Everything we held is free again; let other workers progress.
            time.sleep(random.uniform(0.005, 0.03))

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)


def worker_main(worker_id: int, pool_name: str, conn, model_config: dict,
                max_running: int = 3) -> None:
    """Entry point of a worker process (started by the supervisor)."""
    mgr = shmcache.attach(pool_name)
    chan = Channel(conn, ToWorker)
    model = Model(ModelConfig(**model_config))
    w = Worker(worker_id, mgr, model, max_running)
    chan.send(Ready(worker_id, os.getpid()))
    try:
        while True:
            while chan.poll(0 if w.busy else 0.05):
                msg = chan.recv()
                if isinstance(msg, Shutdown):
                    return
                w.submit(msg)
            if not w.busy:
                continue
            try:
                for d in w.step():
                    chan.send(d)
            except Exception as e:  # a bug in one request must not kill the others
                st = w.running.pop() if w.running else None
                if st is not None:
                    w._release(st)
                    chan.send(Failed(st.req.id, worker_id, f"{type(e).__name__}: {e}"))
                else:
                    raise
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        mgr.close()

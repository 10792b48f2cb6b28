"""A worker's generation engine: continuous batching over the shared pool.

One :class:`Engine` per worker process. Between decode steps it admits
waiting requests; each decode step is one batched forward pass over every
running sample.

Admission (one request at a time):
* acquire the longest published prefix of ``prompt[:-1]`` (one atomic
  lookup-and-reference) and read it from the pool, once, into the request's
  working buffers (:func:`shmcache.mlx_lm.load_prefix`);
* prefill the rest in chunks that end on block boundaries, then the last
  prompt token alone, as mlx-lm's ``generate_step`` with
  ``prefill_step_size = block_size`` does: every chunk starts at the same
  absolute position whoever computes it, and the pool stores K/V in the
  model's dtype, so the tokens never depend on what was cached;
* write each chunk's K/V through to the pool and publish full blocks;
* fork the table for samples 1..n-1 and add every sample as a row of the
  running batch (``PoolBatchKVCache.extend``).

A decode step reserves one slot per row (``prepare_append``: copy-on-write
of a shared partial block), runs the model on the batch, samples each row
(mlx-lm's sampler, seeded per request, sample and step, so a re-run after a
preemption or a worker's death gives the same tokens), writes each row's new
K/V through and publishes blocks as they fill.

With an L2 on the manager (``mgr.l2``: ``shmcache serve --l2``, the
worker attaches with ``l2=``), admission asks it for the chain's next
blocks after the L1 hit (``PoolSequence.acquire``): what it finds is loaded
into new pool blocks and published in L1 before the prefill, which then
starts on the block boundary after it, as after an L1 hit; every block this
worker publishes is queued for L2 (``PoolSequence.publish``; a background
thread writes it).

Out of blocks, the newest request is preempted (its tables deleted, its
published blocks stay cached) and re-run from its prompt later; the
supervisor drops the tokens it already delivered.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from ..errors import OutOfBlocksError
from ..mlx_lm import PoolBatchKVCache, PoolKVCache, PoolSequence, load_prefix, make_pool_cache
from .sampling import RowSampler
from .wire import Gen

log = logging.getLogger("shmcache.engine")


@dataclass
class _Row:
    """One running sample."""
    req: "_Req"
    sample: int
    seq: PoolSequence
    generated: list = field(default_factory=list)
    sampler: Optional[Callable] = None


@dataclass
class _Req:
    gen: Gen
    order: int                      # admission order: the newest is preempted first
    attempt: int = 0
    rows: list = field(default_factory=list)
    preemptions: int = 0


class Engine:
    """Runs requests of one worker over one manager attached to the pool.

    Args:
        mgr: the worker's ``PagedCacheManager``.
        model: an mlx-lm model whose layers all use plain K/V caches.
        eos_ids: token ids that end a sample.
        emit: ``emit(kind, payload)``, called with ("admitted", (id,
            prompt_tokens, cached_tokens)), ("step", [(id, sample, token,
            reason)]) and ("failed", (id, message, status)).
        max_batch: the most samples decoded together.
    """

    def __init__(self, mgr, model, eos_ids, emit, worker_id: int = 0, max_batch: int = 32
                 ) -> None:
        self.mgr = mgr
        self.model = model
        self.eos = set(eos_ids)
        self.emit = emit
        self.wid = worker_id
        self.max_batch = max_batch
        self.bs = mgr.block_size
        self.waiting: deque = deque()
        self.rows: list = []
        self.batch: Optional[list] = None          # one PoolBatchKVCache per layer
        self.preemptions = 0
        self._order = 0
        self._reqs: dict = {}

    # ------------------------------------------------------------ interface
    def submit(self, gen: Gen) -> None:
        self._order += 1
        req = _Req(gen, self._order)
        self._reqs[gen.id] = req
        self.waiting.append(req)

    def cancel(self, rid: int) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._drop_rows(req)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def working_bytes(self) -> int:
        return sum(c.nbytes for c in self.batch) if self.batch else 0

    def step(self) -> None:
        """Admit what fits, then one decode step."""
        self._admit()
        if self.rows:
            self._decode()

    def close(self) -> None:
        for req in list(self._reqs.values()):
            self._drop_rows(req)
        self._reqs.clear()
        self.waiting.clear()

    # ------------------------------------------------------------ admission
    def _admit(self) -> None:
        while self.waiting and len(self.rows) + self.waiting[0].gen.params.n <= self.max_batch:
            req = self.waiting.popleft()
            try:
                ok = self._prefill(req)
            except Exception as e:          # a bug or bad input: fail this request only
                log.exception("request %d failed", req.gen.id)
                self._reqs.pop(req.gen.id, None)
                self._drop_rows(req)
                self.emit("failed", (req.gen.id, f"{type(e).__name__}: {e}", 500))
                continue
            if not ok:
                # out of blocks with nothing of ours to preempt: others hold
                # them; try again after the next step
                self.waiting.appendleft(req)
                break

    def _tables(self, req: _Req, sample: int) -> str:
        return f"w{self.wid}.r{req.gen.id}.a{req.attempt}.s{sample}"

    def _prefill(self, req: _Req) -> bool:
        g, p = req.gen, req.gen.params
        prompt = g.prompt
        extra = (p.salt,) if p.salt else None
        mgr, bs = self.mgr, self.bs
        # the longest cached prefix: L1, then L2 (never raises for an L2 fault)
        seq = PoolSequence.acquire(mgr, self._tables(req, 0), prompt[:-1], extra)
        table, cached = seq.table, seq.stored
        caches = make_pool_cache(self.model, seq)
        load_prefix(caches)
        try:
            pos = cached
            end = len(prompt) - 1
            while pos < end:                       # block-aligned chunks
                stop = min(end, (pos // bs + 1) * bs)
                self._forward_reserved(req, seq, caches, prompt[pos:stop])
                self._publish(seq, prompt)
                pos = stop
            logits = self._forward_reserved(req, seq, caches, prompt[-1:])
            self._publish(seq, prompt)
        except BaseException as e:
            # a failed prefill holds nothing: out of blocks it is retried
            # later, anything else fails the request (the caller reports it)
            mgr.delete_block_table(table.request_id)
            if isinstance(e, OutOfBlocksError):
                return False
            raise
        self.emit("admitted", (g.id, len(prompt), cached))   # the supervisor keeps the first
        # samples 1..n-1 fork the table; their working buffers start as views
        # of sample 0's (MLX arrays are values: later writes never alias)
        rows = [_Row(req, 0, seq)]
        try:
            for j in range(1, p.n):
                rows.append(_Row(req, j, seq.fork(self._tables(req, j))))
        except BaseException:
            for r in rows:
                r.seq.release()
            raise
        per_row = []
        for r in rows:
            r.sampler = RowSampler(p, g.seed, r.sample)
            if r.seq is seq:
                per_row.append(caches)
            else:
                fork = []
                for c in caches:
                    f = PoolKVCache(r.seq, c.layer)
                    f.keys, f.values, f.offset = c.keys[..., :c.offset, :], c.values[..., :c.offset, :], c.offset
                    fork.append(f)
                per_row.append(fork)
        req.rows = rows
        first = [self._sample(r, logits[0]) for r in rows]
        self._add_rows(rows, per_row)
        self._advance(list(zip(rows, first)))
        return True

    def _publish(self, seq: PoolSequence, tokens) -> None:
        """Publish the sequence's full blocks (and queue the new ones for L2)."""
        seq.publish(tokens)

    def _forward_reserved(self, req, seq, caches, tokens):
        seq.reserve(len(tokens))
        out = self.model(mx.array(tokens)[None], cache=caches)[:, -1, :]
        mx.eval(out)
        seq.commit()
        return out

    # --------------------------------------------------------------- decode
    def _add_rows(self, rows, per_row) -> None:
        layers = len(per_row[0])
        new = [PoolBatchKVCache.merge([pr[i] for pr in per_row]) for i in range(layers)]
        if self.batch is None:
            self.batch = new
        else:
            for b, n in zip(self.batch, new):
                b.extend(n)
        self.rows.extend(rows)

    def _keep(self, keep: list) -> None:
        if len(keep) == len(self.rows):
            return
        idx = [i for i, r in enumerate(self.rows) if r in keep]
        self.rows = [self.rows[i] for i in idx]
        if not self.rows:
            self.batch = None
            return
        for b in self.batch:
            b.filter(mx.array(idx))

    def _decode(self) -> None:
        # reserve one slot per row; out of blocks, preempt the newest request
        while True:
            try:
                for r in self.rows:
                    r.seq.reserve(1)
                break
            except OutOfBlocksError:
                if not self._preempt_newest():
                    return
                if not self.rows:
                    return
        y = mx.array([[r.generated[-1]] for r in self.rows])
        logits = self.model(y, cache=self.batch)[:, -1, :]      # (B, V)
        toks = [self._sample(r, logits[i]) for i, r in enumerate(self.rows)]
        mx.eval(toks)
        for r in self.rows:
            r.seq.commit()
        self._advance(list(zip(self.rows, toks)))

    def _sample(self, r: _Row, logits: mx.array) -> mx.array:
        # mlx-lm's processors and sampler, seeded per (request, sample,
        # step): the same tokens on any worker and after any preemption
        return r.sampler(logits, r.req.gen.prompt, r.generated)

    def _advance(self, pairs) -> None:
        items, finished = [], set()
        for r, t in pairs:
            t = int(t)
            r.generated.append(t)
            p = r.req.gen.params
            reason = ""
            if t in self.eos or t in p.stop_token_ids:
                reason = "stop"
            elif len(r.generated) >= p.max_tokens:
                reason = "length"
            items.append((r.req.gen.id, r.sample, t, reason, r.sampler.take_logprobs()))
            if reason:
                finished.add(id(r))
            else:
                # publish the blocks that filled (prompt + generated tokens)
                self._publish(r.seq, r.req.gen.prompt + r.generated)
        self.emit("step", items)
        if finished:
            for r in self.rows:
                if id(r) in finished:
                    self._publish(r.seq, r.req.gen.prompt + r.generated[:-1])
                    r.seq.release()
            keep = [r for r in self.rows if id(r) not in finished]
            for req in {r.req.gen.id: r.req for r in self.rows if id(r) in finished}.values():
                req.rows = [r for r in req.rows if id(r) not in finished]
                if not req.rows:
                    self._reqs.pop(req.gen.id, None)
            self._keep(keep)

    # ------------------------------------------------------------ pressure
    def _drop_rows(self, req: _Req) -> None:
        mine = set(map(id, req.rows))
        for r in req.rows:
            try:
                r.seq.release()
            except Exception:            # already gone (a failed prefill)
                pass
        req.rows = []
        self._keep([r for r in self.rows if id(r) not in mine])

    def _preempt_newest(self) -> bool:
        live = {r.req.gen.id: r.req for r in self.rows}
        if not live:
            return False
        req = max(live.values(), key=lambda q: q.order)
        self._drop_rows(req)
        req.attempt += 1
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
        log.info("worker %d: out of blocks, preempted request %d", self.wid, req.gen.id)
        return True

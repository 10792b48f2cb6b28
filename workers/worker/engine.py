"""A worker's generation engine: continuous batching over the shared pool.

One :class:`Engine` per worker process. Between decode steps it admits
waiting requests; each decode step is one batched forward pass over every
running sample.

Admission and prefill share the step with decode. A request that reaches
the head of the queue when the batch has room for its samples starts its
prefill:
* acquire the longest published prefix of ``prompt[:-1]`` (one atomic
  lookup-and-reference, as late as possible, so that it sees what every
  other worker published until then) and read it from the pool, once, into
  the request's working buffers (:func:`shmcache.models.mlx_lm.load_prefix`);
* compute the rest of ``prompt[:-1]`` in chunks of up to ``prefill_step``
  tokens (a multiple of the block size: every chunk after the cache-hit
  boundary ends on a block boundary or at ``prompt[:-1]``'s end), evaluating
  only the K/V (no logits), as mlx-lm's ``generate_step`` does with its
  ``prefill_step_size``;
* write each chunk's K/V through to the pool and publish the full blocks
  right away (another worker's request with the same prefix, held back by
  the supervisor, starts as soon as the blocks it shares are published:
  ``Progress``);
* fork the table for samples 1..n-1 and add every sample as a row of the
  running batch (``PoolBatchKVCache.extend``). The last prompt token is the
  row's first input: it goes through the next decode step, in the batch,
  whose logits give the first token (mlx-lm computes it alone after the
  prefill; here it costs no forward pass of its own: on a CPU a forward
  pass reads every weight, so a one-token pass costs about a decode step).

Working buffers: each row's K/V also lives in this process, in mlx-lm's
``BatchKVCache`` (every row as long as the longest), so a worker's memory
grows with rows x context whatever the pool shares. With
``max_working_bytes``, the head of the queue starts only when the batch's
peak with it (:meth:`Engine.working_need`) fits; it waits for running rows
to finish, and one that could never fit, even alone, fails with a 400 that
says so.

INVARIANT: a step spends at most ``prefill_step`` prompt tokens on prefill
before its decode step (``decoding_prefill_step``, at most as many, when it
starts with running rows), so the running rows get a token every step
whatever is being admitted (chunked prefill mixed with decode, as vLLM's
scheduler budgets tokens per step). Requests start in arrival order.
Those at the head of the queue whose rest of ``prompt[:-1]`` (after their
cache hits) fits one chunk of the step's budget are admitted together:
their cached prefixes are read from the pool as each starts, merged into
one ``PoolBatchKVCache`` (left padding) and their chunks computed in ONE
forward pass, right-padded to the longest (rows x width counts against the
budget), as mlx-lm's ``BatchGenerator`` prefills; then they join the
running batch. A longer prompt is prefilled alone, in chunks, one request
at a time; a cancelled one stops between two chunks. Greedy tokens stay
mlx-lm's ``generate_step``'s (tests/test_engine.py checks the batched
admission on llama, qwen2 and qwen3).

A decode step reserves one slot per row (``prepare_append``: copy-on-write
of a shared partial block), runs the model on the batch, samples each row
(mlx-lm's sampler, seeded per request, sample and step, so a re-run after a
preemption or a worker's death gives the same tokens), writes each row's new
K/V through and publishes blocks as they fill.

With an L2 on the manager (``mgr.l2``: ``shmcache serve --l2``, the
worker attaches with ``l2=``), admission asks it for the chain's next
blocks after the L1 hit (``PoolSequence.begin``) on the L2's fetch thread,
and decode steps go on while it waits: the prefill starts when the lookup
is done or its deadline (``--l2-timeout``, for the lookup as a whole) has
passed. What arrived is loaded into new pool blocks and published in L1
before the prefill, which then starts on the block boundary after it, as
after an L1 hit; the rest is computed. Every block this worker publishes is
queued for L2 (``PoolSequence.publish``; a background thread writes it).

A prefill handed over (``Gen.handoff``, the supervisor's ``--handoff-tokens``):
the request's ``prompt[:-1]`` is computed and published as above, but its
table is kept ("parked") instead of joining the batch, and ``("handoff",
(id, table, stored, cached))`` is emitted; the worker that then decodes it
gets it with ``Gen.adopt`` naming that table, forks it
(:meth:`PoolSequence.adopt`: every block shared, the partial last one too),
reads it into its working buffers and joins its batch with nothing to
compute, as a request whose prompt is all cached. The parked table is
dropped on ``unpark`` (the adopter has its fork) or ``cancel``. Gone (the
computing worker died), the adopter computes what the pool does not hold.
So a worker that decodes a full batch need not stop it for a long prefill:
on a CPU a decode step costs about the same for 1 or 4 rows (it reads every
weight once), while prefill is bound by compute, so few, full decoding
batches lose little while the prompts are computed on the other workers'
cores (docs/decisions/0019-prefill-handoff.md has what it gains and costs).

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

from shmcache.errors import OutOfBlocksError
from shmcache.shm.layout import ITEMSIZE
from shmcache.models.mlx_lm import (PendingSequence, PoolBatchKVCache, PoolKVCache, PoolSequence,
                             load_prefix, make_pool_cache)
from .sampling import RowSampler
from ..wire import Gen
from . import step_timing

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


@dataclass
class _Prefill:
    """A request whose prompt is being computed: its sequence holds the
    cached prefix and every chunk computed so far (``seq.stored``). While
    ``pending`` is set, its L2 lookup is in flight: ``seq`` and ``caches``
    are None until it is ready (:meth:`Engine._finish_start`)."""
    req: _Req
    seq: Optional[PoolSequence]
    caches: Optional[list]          # one PoolKVCache per layer: the working buffers
    cached: int                     # prompt tokens found in the pool
    pending: Optional[PendingSequence] = None

    def release(self) -> None:
        """Give back what it holds (a failed or cancelled prefill)."""
        if self.pending is not None:
            self.pending.release()
            self.pending = None
        elif self.seq is not None:
            self.seq.release()


KV_STEP = 256                       # mlx-lm's KVCache grows its buffers in steps of this


class Engine:
    """Runs requests of one worker over one manager attached to the pool.

    Args:
        mgr: the worker's ``PagedCacheManager``.
        model: an mlx-lm model whose layers all use plain K/V caches.
        eos_ids: token ids that end a sample.
        emit: ``emit(kind, payload)``, called with ("admitted", (id,
            prompt_tokens, cached_tokens)), ("progress", (id, tokens
            stored)), ("step", [(id, sample, token, reason, logprob or None)]),
            ("handoff", (id, table, tokens stored, cached_tokens)) and
            ("failed", (id, message, status)).
        max_batch: the most samples decoded together.
        prefill_step: the most prompt tokens computed per step (rounded
            down to a multiple of the block size, at least one block).
        max_working_bytes: the most bytes of working K/V buffers (this
            process's own MLX arrays, whatever the pool shares) the batch may
            reach (None: no limit). See :meth:`working_need`.
        decoding_prefill_step: the most prompt tokens computed in a step
            that starts with running rows (rounded as ``prefill_step``; None:
            ``prefill_step``). On a CPU a step's prefill costs about its
            tokens' share of the compute, all of it a pause for the rows.
    """

    def __init__(self, mgr, model, eos_ids, emit, worker_id: int = 0, max_batch: int = 32,
                 prefill_step: int = 512, max_working_bytes: Optional[int] = None,
                 decoding_prefill_step: Optional[int] = None) -> None:
        self.mgr = mgr
        self.model = model
        self.eos = set(eos_ids)
        self.emit = emit
        self.wid = worker_id
        self.max_batch = max_batch
        self.bs = mgr.block_size
        self.prefill_step = max(self.bs, prefill_step // self.bs * self.bs)
        d = prefill_step if decoding_prefill_step is None else decoding_prefill_step
        self.decoding_prefill_step = min(self.prefill_step, max(self.bs, d // self.bs * self.bs))
        self.max_working_bytes = max_working_bytes
        lay = mgr.layout
        # one token's K and V in every layer, as the working buffers hold them
        self.token_bytes = lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * \
            ITEMSIZE[lay.dtype]
        self.waiting: deque = deque()
        self.prefilling: Optional[_Prefill] = None
        self.rows: list = []
        self.batch: Optional[list] = None          # one PoolBatchKVCache per layer
        self.preemptions = 0
        self._order = 0
        self._reqs: dict = {}
        self._parked: dict = {}            # request id -> its PoolSequence kept after "handoff"
        step_timing.install(self)

    # ------------------------------------------------------------ interface
    def submit(self, gen: Gen) -> None:
        self._order += 1
        req = _Req(gen, self._order)
        self._reqs[gen.id] = req
        self.waiting.append(req)

    def cancel(self, rid: int) -> None:
        self.unpark(rid)
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        pf = self.prefilling
        if pf is not None and pf.req is req:
            self.prefilling = None
            pf.release()
        self._drop_rows(req)

    def unpark(self, rid: int) -> None:
        """Drop the table kept for ``rid`` after its handoff (if any)."""
        seq = self._parked.pop(rid, None)
        if seq is not None:
            seq.release()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting or self.prefilling)

    @property
    def waiting_on_l2(self) -> bool:
        """Nothing to compute until an L2 lookup is ready (the caller may sleep a little)."""
        pf = self.prefilling
        return not self.rows and pf is not None and pf.pending is not None and \
            not pf.pending.ready()

    def working_bytes(self) -> int:
        """Bytes of working K/V buffers now: the batch's and the prefill's."""
        n = sum(c.nbytes for c in self.batch) if self.batch else 0
        pf = self.prefilling
        if pf is not None and pf.caches:
            n += sum(c.nbytes for c in pf.caches)
        return n

    def working_need(self, req: "_Req", alone: bool = False, joining=()) -> int:
        """Working-buffer bytes of the batch at its peak if ``req``'s samples join it.

        Every row of mlx-lm's ``BatchKVCache`` spans the batch's longest
        row (left padding), and a row grows to its prompt plus
        ``max_tokens``; so the peak is at most (rows) x (the longest final
        length, rounded up to mlx-lm's 256-token steps) x ``token_bytes``.
        ``alone``: ``req``'s samples in a batch of their own; ``joining``:
        requests admitted in the same step, ahead of ``req``.
        """
        def end(g) -> int:
            return len(g.prompt) + g.params.max_tokens
        rows = [] if alone else self.rows
        others = [] if alone else list(joining)
        longest = max([end(req.gen)] + [end(r.req.gen) for r in rows] +
                      [end(q.gen) for q in others])
        longest = -(-longest // KV_STEP) * KV_STEP
        n = len(rows) + req.gen.params.n + sum(q.gen.params.n for q in others)
        return n * longest * self.token_bytes

    def step(self) -> None:
        """Up to ``prefill_step`` prompt tokens of prefill, then one decode step."""
        step_timing.begin(self)
        self._admit()
        if self.rows:
            self._decode()
        step_timing.end(self)

    def close(self) -> None:
        if self.prefilling is not None:
            self.prefilling.release()
            self.prefilling = None
        for req in list(self._reqs.values()):
            self._drop_rows(req)
        self._reqs.clear()
        for rid in list(self._parked):
            self.unpark(rid)
        self.waiting.clear()
        step_timing.close(self)

    # ------------------------------------------------------------ admission
    def _admit(self) -> None:
        budget = self.decoding_prefill_step if self.rows else self.prefill_step
        while budget > 0:
            if self.prefilling is None:
                group, rest = self._start_next(budget)
                if not group and rest is None:
                    return               # nothing may start now
                if group:
                    used, cut = self._prefill_group(group)
                    budget -= used
                    if cut:              # out of blocks: the rest waits, in order
                        if rest is not None:
                            rest.release()
                            self.waiting.insert(cut, rest.req)
                        return
                self.prefilling = rest
                if rest is None or budget <= 0:
                    continue
            pf = self.prefilling
            if pf.pending is not None:
                # its L2 lookup is in flight: decode goes on meanwhile; the
                # prefill starts when it is done or its deadline has passed
                if not pf.pending.ready():
                    return
                try:
                    self._finish_start(pf)
                except Exception as e:
                    self.prefilling = None
                    pf.release()
                    self._fail(pf.req, e)
                    continue
            try:
                used, done = self._prefill_chunk(pf, budget)
            except Exception as e:
                self.prefilling = None
                pf.release()             # a failed prefill holds nothing
                if isinstance(e, OutOfBlocksError):
                    # others hold the blocks: try again after the next step
                    # (from its prompt: the published chunks stay cached)
                    self.waiting.appendleft(pf.req)
                    return
                self._fail(pf.req, e)
                continue
            budget -= used
            if not done:
                if used == 0:
                    return               # the next chunk does not fit this step's budget
                continue
            self.prefilling = None
            if pf.req.gen.handoff:
                self._park(pf)
                continue
            try:
                self._to_rows(pf)
            except OutOfBlocksError:
                # no room for the last prompt token: as a prefill out of
                # blocks, try again after the next step (the chunks stay cached)
                self.waiting.appendleft(pf.req)
                return
            except Exception as e:
                self._fail(pf.req, e)

    def _start_next(self, budget: int):
        """Start requests from the head of the queue while they may join the
        batch: those whose rest of ``prompt[:-1]`` (after the cache hit) fits
        one shared chunk within ``budget`` form a group (prefilled together,
        :meth:`_prefill_group`; handed-over prefills too, which are then
        parked instead of joining the batch); the first that does not (a
        longer prompt, n > 1, an L2 lookup in flight) ends the group as
        ``rest``, to be prefilled alone in chunks. Returns ``(group, rest)``."""
        group: list = []
        width = computed = 0          # the group's chunk width, rows that compute
        while self.waiting:
            head = self.waiting[0]
            joining = [pf.req for pf in group]
            if len(self.rows) + sum(q.gen.params.n for q in joining) + head.gen.params.n > \
                    self.max_batch:
                break
            if self.max_working_bytes and not self._fits(head, joining):
                if self.rows or group:
                    break                # waits for running rows to finish
                self._refuse(self.waiting.popleft())
                continue
            req = self.waiting.popleft()
            try:
                pf = self._start(req)
            except Exception as e:
                self._fail(req, e)
                continue
            if pf.pending is None and req.gen.params.n == 1:
                rest = len(req.gen.prompt) - 1 - pf.seq.stored
                if rest == 0:
                    group.append(pf)     # all cached: nothing to compute
                    continue
                if (computed + 1) * max(width, rest) <= budget:
                    group.append(pf)
                    width, computed = max(width, rest), computed + 1
                    continue
            return group, pf
        return group, None

    def _prefill_group(self, group: list):
        """Compute the rest of ``prompt[:-1]`` of every request of ``group``
        (one chunk each) and add their rows to the batch. Two or more that
        compute share ONE forward pass: their cached prefixes (read from the
        pool at their start) merged into one ``PoolBatchKVCache`` (left
        padding), their chunks right-padded to the longest, as mlx-lm's
        ``BatchGenerator`` prefills. Every member reserves its chunk and its
        first decode slot first, in order (a handed-over one only its chunk:
        its table is parked, :meth:`_park`, and another worker decodes it):
        out of blocks, that member and the ones after it are released and go
        back to the head of the queue, in order, and the others go on.

        Returns ``(tokens spent, cut)``: the prompt tokens computed (rows x
        the chunk width, padding included) and how many requests went back
        to the queue (0: none).
        """
        cut = 0
        for i, pf in enumerate(group):
            try:
                pf.seq.reserve(len(pf.req.gen.prompt) - pf.seq.stored - pf.req.gen.handoff)
            except OutOfBlocksError:
                cut = len(group) - i
                self._requeue(group[i:])
                group = group[:i]
                break
        fresh = [pf for pf in group if len(pf.req.gen.prompt) - 1 > pf.seq.stored]
        computes = {id(pf) for pf in fresh}
        if len(fresh) < 2:               # the one-request path: its own caches
            used = 0
            for i, pf in enumerate(group):
                try:
                    if id(pf) in computes:
                        used, _ = self._prefill_chunk(pf, self.prefill_step)
                except Exception as e:
                    pf.release()
                    self._fail(pf.req, e)
                    continue
                self._admit_computed(pf)
            return used, cut
        rests = [len(pf.req.gen.prompt) - 1 - pf.seq.stored for pf in fresh]
        width = max(rests)
        try:
            batch = [PoolBatchKVCache.merge([pf.caches[i] for pf in fresh])
                     for i in range(len(fresh[0].caches))]
            pad = [width - n for n in rests]
            for c in batch:
                c.prepare(lengths=rests, right_padding=pad)
            toks = [pf.req.gen.prompt[pf.seq.stored:pf.seq.stored + n] + [0] * p
                    for pf, n, p in zip(fresh, rests, pad)]
            self.model(mx.array(toks), cache=batch)
            mx.eval([a for c in batch for a in (c.keys, c.values)])
            for c in batch:
                c.finalize()
            for pf in fresh:
                pf.seq.commit()
                pf.seq.publish(pf.req.gen.prompt)
                self.emit("progress", (pf.req.gen.id, pf.seq.stored))
        except Exception as e:           # a bug: fail these requests only
            for pf in fresh:
                pf.release()
                self._fail(pf.req, e)
            fresh = []
        for pf in group:
            if id(pf) not in computes:
                self._admit_computed(pf)     # all cached
        rows, keep = [], []
        for i, pf in enumerate(fresh):
            g = pf.req.gen
            if g.handoff:
                self._park(pf)
                continue
            self.emit("admitted", (g.id, len(g.prompt), pf.cached))
            r = _Row(pf.req, 0, pf.seq, sampler=RowSampler(g.params, g.seed, 0))
            pf.req.rows = [r]
            rows.append(r)
            keep.append(i)
        if rows:
            if len(keep) < len(fresh):   # (the parked ones' working buffers go)
                for c in batch:
                    c.filter(mx.array(keep))
            self._extend_batch(rows, batch)
        return len(fresh) * width, cut

    def _admit_computed(self, pf: _Prefill) -> None:
        """``pf``'s ``prompt[:-1]`` is stored: its rows join the batch
        (:meth:`_to_rows`; its slots are reserved: no OutOfBlocksError), or
        a handed-over one is parked (:meth:`_park`)."""
        if pf.req.gen.handoff:
            self._park(pf)
            return
        try:
            self._to_rows(pf)
        except Exception as e:
            self._fail(pf.req, e)

    def _requeue(self, pfs: list) -> None:
        """Release started prefills and put them back at the head of the queue, in order."""
        for pf in reversed(pfs):
            pf.release()
            self.waiting.appendleft(pf.req)

    def _fits(self, req: _Req, joining=()) -> bool:
        return self.working_need(req, joining=joining) <= self.max_working_bytes

    def _refuse(self, req: _Req) -> None:
        """``req`` alone needs more working buffers than this worker may have."""
        p, need = req.gen.params, self.working_need(req, alone=True)
        msg = (f"this request needs {need / 2**20:,.0f} MiB of working K/V buffers ({p.n} "
               f"sample(s) x {len(req.gen.prompt) + p.max_tokens:,} tokens of prompt and "
               f"max_tokens), more than a worker may use (--max-working-bytes "
               f"{self.max_working_bytes / 2**20:,.0f} MiB); lower max_tokens, n or the prompt")
        log.warning("request %d refused: %s", req.gen.id, msg)
        self._reqs.pop(req.gen.id, None)
        self.emit("failed", (req.gen.id, msg, 400))

    def _fail(self, req: _Req, e: BaseException) -> None:
        """A bug or bad input: fail this request only."""
        log.error("request %d failed: %s: %s", req.gen.id, type(e).__name__, e,
                  exc_info=not isinstance(e, (ValueError, OutOfBlocksError)))
        self._reqs.pop(req.gen.id, None)
        self._drop_rows(req)
        self.emit("failed", (req.gen.id, f"{type(e).__name__}: {e}", 500))

    def _tables(self, req: _Req, sample: int) -> str:
        # (a handoff's table is parked: named apart from the one this
        # worker's own adoption of it would fork into)
        tail = "h" if req.gen.handoff else f"s{sample}"
        return f"w{self.wid}.r{req.gen.id}.a{req.attempt}.{tail}"

    def _start(self, req: _Req) -> _Prefill:
        """Take the longest cached prefix in L1 and start its L2 lookup
        (``PoolSequence.begin``: never raises for an L2 fault); with no
        lookup in flight, load it into new working buffers now. With
        ``Gen.adopt``, fork that table instead while it holds this prompt's
        ``prompt[:-1]`` (a handed-over prefill)."""
        p = req.gen.params
        extra = (p.salt,) if p.salt else None
        # (a re-run after a preemption does not adopt: the table was dropped
        # once this worker admitted it, and the published blocks are cached)
        seq = self._adopt(req, extra) if req.gen.adopt and req.attempt == 0 else None
        if seq is not None:
            pf = _Prefill(req, seq, None, 0)
            try:
                self._load(pf)
            except BaseException:
                pf.release()
                raise
            return pf
        pending = PoolSequence.begin(self.mgr, self._tables(req, 0), req.gen.prompt[:-1], extra)
        pf = _Prefill(req, None, None, 0, pending)
        if pending.ready():
            try:
                self._finish_start(pf)
            except BaseException:
                pf.release()
                raise
        return pf

    def _finish_start(self, pf: _Prefill) -> None:
        """The L2 lookup is ready: load what it delivered into the pool
        (published in L1), then the whole prefix into new working buffers."""
        pf.seq = pf.pending.finish()
        pf.pending = None
        self._load(pf)

    def _load(self, pf: _Prefill) -> None:
        """``pf.seq``'s tokens (its cached prefix) into new working buffers."""
        caches = make_pool_cache(self.model, pf.seq)
        load_prefix(caches)
        pf.caches, pf.cached = caches, pf.seq.stored
        self.emit("progress", (pf.req.gen.id, pf.seq.stored))

    def _adopt(self, req: _Req, extra) -> Optional[PoolSequence]:
        """A fork of the handed-over table ``req.gen.adopt`` while it holds
        this prompt's ``prompt[:-1]``; None (said in a warning) when it is
        gone, and the request computes as usual."""
        seq = PoolSequence.adopt(self.mgr, req.gen.adopt, self._tables(req, 0), extra)
        if seq is not None and seq.stored != len(req.gen.prompt) - 1:
            seq.release()                # not this prompt's
            seq = None
        if seq is None:
            log.warning("request %d: its handed-over prefill (table %s) is gone: "
                        "computing what the pool does not hold", req.gen.id, req.gen.adopt)
        return seq

    def _park(self, pf: _Prefill) -> None:
        """A handoff's ``prompt[:-1]`` is computed: keep its table for the
        adopting worker (until ``unpark``) and say so."""
        g = pf.req.gen
        self._reqs.pop(g.id, None)
        self._parked[g.id] = pf.seq
        self.emit("handoff", (g.id, pf.seq.table.request_id, pf.seq.stored, pf.cached))

    def _prefill_chunk(self, pf: _Prefill, budget: int):
        """Compute the next chunk of ``pf``'s ``prompt[:-1]`` within ``budget`` tokens.

        Returns ``(tokens computed, done)``: ``done`` once ``prompt[:-1]`` is
        stored (the last prompt token goes through the next decode step, in
        the batch). A chunk that stops short of ``prompt[:-1]``'s end ends on
        a block boundary (the pool's chunks are the same whoever computes
        them); ``(0, False)`` when none fits the budget.
        """
        prompt, bs = pf.req.gen.prompt, self.bs
        pos, end = pf.seq.stored, len(prompt) - 1
        if pos >= end:
            return 0, True
        n = min(end - pos, budget)
        if pos + n < end:
            n = (pos + n) // bs * bs - pos
        if n <= 0:
            return 0, False
        self._forward_chunk(pf.seq, pf.caches, prompt[pos:pos + n])
        pf.seq.publish(prompt)
        self.emit("progress", (pf.req.gen.id, pf.seq.stored))
        return n, pos + n >= end

    def _to_rows(self, pf: _Prefill) -> None:
        """``prompt[:-1]`` is computed: the samples become rows of the batch;
        each row's first input is the last prompt token (its first token
        comes out of the next decode step, as mlx-lm's ``generate_step``
        computes the last prompt token alone after the prefill)."""
        req, seq, caches = pf.req, pf.seq, pf.caches
        g, p = req.gen, req.gen.params
        # samples 1..n-1 fork the table; their working buffers start as views
        # of sample 0's (MLX arrays are values: later writes never alias).
        # Every row reserves its slot for the last prompt token now: out of
        # blocks, the request goes back to the queue instead of joining the
        # batch to be preempted by the next decode step (OutOfBlocksError,
        # everything released)
        rows = [_Row(req, 0, seq)]
        try:
            for j in range(1, p.n):
                rows.append(_Row(req, j, seq.fork(self._tables(req, j))))
            for r in rows:
                r.seq.reserve(1)
        except BaseException:
            for r in rows:
                r.seq.release()
            raise
        self.emit("admitted", (g.id, len(g.prompt), pf.cached))   # the supervisor keeps the first
        per_row = []
        for r in rows:
            r.sampler = RowSampler(p, g.seed, r.sample)
            if r.seq is seq:
                per_row.append(caches)
            else:
                fork = []
                for c in caches:
                    f = PoolKVCache(r.seq, c.layer)
                    if c.keys is not None:
                        f.keys, f.values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
                    f.offset = c.offset
                    fork.append(f)
                per_row.append(fork)
        req.rows = rows
        self._add_rows(rows, per_row)

    def _forward_chunk(self, seq, caches, tokens) -> None:
        """K/V of ``tokens`` into the working buffers and the pool. Only the
        caches are evaluated, as mlx-lm's prefill does: the last layer's
        attention output, MLP and the logits, which no K/V depends on, are
        never computed."""
        seq.reserve(len(tokens))
        self.model(mx.array(tokens)[None], cache=caches)
        mx.eval([a for c in caches for a in (c.keys, c.values)])
        seq.commit()

    # --------------------------------------------------------------- decode
    def _add_rows(self, rows, per_row) -> None:
        layers = len(per_row[0])
        self._extend_batch(rows, [PoolBatchKVCache.merge([pr[i] for pr in per_row])
                                  for i in range(layers)])

    def _extend_batch(self, rows, new) -> None:
        """``rows`` join the running batch; ``new``: their batch caches, one per layer."""
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
        # a new row's input is its last prompt token, the others' their last token
        y = mx.array([[r.generated[-1] if r.generated else r.req.gen.prompt[-1]]
                      for r in self.rows])
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
                r.seq.publish(r.req.gen.prompt + r.generated)
        self.emit("step", items)
        if finished:
            for r in self.rows:
                if id(r) in finished:
                    r.seq.publish(r.req.gen.prompt + r.generated[:-1])
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

"""Unit tests of the worker's generation engine (``workers.worker.engine.Engine``)
over fakes, as vLLM tests its scheduler: what the engine decides, step by step.

The fakes stand in for the pool and the model IN THIS FILE ONLY:

* ``FakeSequence`` replaces ``PoolSequence`` (and ``FakeCache``/``FakeBatch``
  the pool-backed K/V caches): it counts blocks against a ``FakeManager``'s
  free count (a partly filled shared block is copied on a fork's first
  append) and raises ``OutOfBlocksError`` as the pool does, with no shared
  memory behind it;
* ``FakeModel`` returns logits that are a fixed function of the last token
  (so a re-run computes the same ones) and records every forward pass.

The sampler is the real one (``RowSampler``: mlx-lm's sampler and processors).
``tests/test_engine.py`` runs the same engine over a real pool and real
mlx-lm models.

What is checked: preemption takes the newest request first and re-queues it
at the head; seeded sampling gives the same tokens after a preemption; the
samples of an ``n > 1`` request fork one prefill, and the last prompt token
goes through the decode step; no step computes more than
``prefill_step`` prompt tokens, and a running row still gets a token every
step; a cancel during prefill releases the request's blocks and stops it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shmcache.errors import OutOfBlocksError
from workers.worker import engine as engine_mod
from workers.worker.engine import Engine
from workers.protocol import SamplingParams
from workers.wire import Gen

import mlx.core as mx  # noqa: E402  (after shmcache: the fast BLAS)
import numpy as np  # noqa: E402

BS = 4                  # tokens per block
VOCAB = 32
LAYERS = 2


def _blocks(tokens: int) -> int:
    return -(-tokens // BS)


# ------------------------------------------------------------------ fakes
class FakeManager:
    """The pool's block accounting only: ``free`` blocks, ``cached`` prefixes."""

    def __init__(self, blocks: int) -> None:
        self.block_size = BS
        self.total = self.free = blocks
        self.cached: dict = {}          # tuple(prompt[:-1]) -> tokens found in the pool
        self.acquired: list = []        # table names acquired (one per prefill start)
        self.forks: list = []           # (parent name, fork name, parent's stored tokens)
        # what the engine reads of the pool's layout (its working-buffer sums)
        self.layout = SimpleNamespace(num_layers=LAYERS, num_kv_heads=1, head_dim=1,
                                      dtype="float32")


class FakeSequence:
    """One block table: ``stored`` tokens in ``own`` blocks of its own plus
    ``shared`` full blocks shared with the sequence it was forked from."""

    def __init__(self, mgr: FakeManager, name: str, stored: int = 0, shared: int = 0) -> None:
        self.mgr, self.name, self.stored, self.shared = mgr, name, stored, shared
        self.own = 0
        self.pending = 0
        self.staged = None              # tokens a batch prefill computed (FakeModel sets it)
        self.released = False
        self.published: list = []

    @classmethod
    def acquire(cls, mgr, name, tokens, extra=None):
        hit = mgr.cached.get(tuple(tokens), 0)
        mgr.acquired.append(name)
        seq = cls(mgr, name, hit, shared=hit // BS)
        return seq

    @classmethod
    def begin(cls, mgr, name, tokens, extra=None):
        """The engine's way in (no L2 here: ready at once)."""
        return FakePending(cls.acquire(mgr, name, tokens, extra))

    def reserve(self, n: int) -> None:
        # idempotent until commit, as the pool's (the engine retries a step)
        need = _blocks(self.stored + n) - self.shared - self.own
        if need > self.mgr.free:
            raise OutOfBlocksError(f"need {need} blocks, {self.mgr.free} free")
        if need > 0:
            self.mgr.free -= need
            self.own += need
        self.pending = n

    def commit(self) -> None:
        # what was computed: a batch prefill's real tokens, else all reserved
        n = self.pending if self.staged is None else self.staged
        self.stored += n
        self.pending -= n
        self.staged = None

    def publish(self, tokens) -> None:
        self.published.append(len(tokens))

    def fork(self, name: str) -> "FakeSequence":
        self.mgr.forks.append((self.name, name, self.stored))
        return FakeSequence(self.mgr, name, self.stored, shared=self.stored // BS)

    def release(self) -> None:
        if not self.released:
            self.mgr.free += self.own
            self.own = 0
            self.released = True


class FakePending:
    """``PendingSequence`` with no L2 lookup: ready, ``finish`` gives the sequence."""

    def __init__(self, seq: FakeSequence) -> None:
        self.seq = seq

    def ready(self) -> bool:
        return True

    def finish(self) -> FakeSequence:
        return self.seq

    def release(self) -> None:
        self.seq.release()


class FakeCache:
    """One layer's working K/V of one sequence (only lengths matter)."""

    def __init__(self, seq: FakeSequence, layer: int) -> None:
        self.seq, self.layer = seq, layer
        self.offset = 0
        self.keys = self.values = mx.zeros((1, 1, 0, 1))

    def grow(self, n: int) -> None:
        self.offset += n
        self.keys = self.values = mx.zeros((1, 1, self.offset, 1))


class FakeBatch:
    """One layer's batched caches: the rows' sequences, in batch order."""

    def __init__(self, seqs: list) -> None:
        self.seqs = seqs
        self.lengths = None             # a batch prefill's real tokens per row
        self.keys = self.values = mx.zeros((len(seqs), 1, 0, 1))

    @classmethod
    def merge(cls, caches):
        return cls([c.seq for c in caches])

    def prepare(self, lengths=None, right_padding=None) -> None:
        self.lengths = list(lengths)

    def finalize(self) -> None:
        self.lengths = None

    def extend(self, other: "FakeBatch") -> None:
        self.seqs = self.seqs + other.seqs

    def filter(self, idx) -> None:
        self.seqs = [self.seqs[i] for i in idx.tolist()]

    @property
    def nbytes(self) -> int:
        return 16 * len(self.seqs)


def make_pool_cache(model, seq):
    return [FakeCache(seq, i) for i in range(LAYERS)]


def load_prefix(caches) -> None:
    for c in caches:
        c.grow(c.seq.stored)


class FakeModel:
    """Logits a fixed pseudo-random function of the last token; records
    ("prefill", sequence name, tokens), ("batch-prefill", sequence names,
    padded width) or ("decode", sequence names) per call."""

    def __init__(self) -> None:
        self.calls: list = []
        self.table = np.random.default_rng(7).normal(size=(VOCAB, VOCAB)).astype(np.float32)

    def __call__(self, x, cache):
        b, t = x.shape
        if isinstance(cache[0], FakeBatch) and cache[0].lengths is not None:
            seqs = cache[0].seqs
            self.calls.append(("batch-prefill", [s.name for s in seqs], t))
            for s, n in zip(seqs, cache[0].lengths):
                s.staged = n
        elif isinstance(cache[0], FakeBatch):
            self.calls.append(("decode", [s.name for s in cache[0].seqs]))
        else:
            self.calls.append(("prefill", cache[0].seq.name, t))
            for c in cache:
                c.grow(t)
        last = np.array(x)[:, -1]
        out = np.zeros((b, t, VOCAB), np.float32)
        out[:, -1, :] = self.table[last]
        return mx.array(out)


class Events:
    """What the engine emits, by kind."""

    def __init__(self) -> None:
        self.log: list = []

    def __call__(self, kind, payload) -> None:
        self.log.append((kind, payload))

    def tokens(self, rid: int, sample: int = 0) -> list:
        return [t for k, p in self.log if k == "step" for (i, s, t, _, _) in p
                if i == rid and s == sample]

    def kinds(self, rid: int) -> list:
        return [k for k, p in self.log
                if (k == "step" and any(i == rid for i, *_ in p)) or (k != "step" and p[0] == rid)]


@pytest.fixture
def fakes(monkeypatch):
    """Put the fakes where the engine module looks up the pool's classes."""
    monkeypatch.setattr(engine_mod, "PoolSequence", FakeSequence)
    monkeypatch.setattr(engine_mod, "PoolKVCache", FakeCache)
    monkeypatch.setattr(engine_mod, "PoolBatchKVCache", FakeBatch)
    monkeypatch.setattr(engine_mod, "make_pool_cache", make_pool_cache)
    monkeypatch.setattr(engine_mod, "load_prefix", load_prefix)


def make_engine(blocks: int, **kw):
    mgr, model, ev = FakeManager(blocks), FakeModel(), Events()
    return Engine(mgr, model, eos_ids=[], emit=ev, **kw), mgr, model, ev


def gen(rid: int, prompt_len: int, max_tokens: int = 40, seed: int = 0, **params) -> Gen:
    prompt = [(rid * 7 + i) % VOCAB for i in range(prompt_len)]
    p = SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0.0),
                       **params)
    return Gen(rid, prompt, p, seed)


def run_until(eng, cond, limit: int = 200) -> int:
    for i in range(limit):
        if cond():
            return i
        eng.step()
    raise AssertionError("the condition never held")


# ------------------------------------------------------------------ tests
@pytest.mark.timeout(60)
def test_preemption_takes_the_newest_request_and_requeues_it_at_the_head(fakes):
    # three 5-token prompts (2 blocks each) fill 6 of 7 blocks; every request
    # needs a 3rd block at its 9th token, and only one is free
    eng, mgr, model, ev = make_engine(7, max_batch=3)
    for rid in (1, 2, 3):
        eng.submit(gen(rid, 5))
    eng.step()
    assert [r.req.gen.id for r in eng.rows] == [1, 2, 3] and mgr.free == 1

    preempted = []          # (preempted id, waiting ids right after)
    seen = 0
    for _ in range(40):
        eng.step()
        if eng.preemptions > seen:
            seen = eng.preemptions
            preempted.append((eng.waiting[0].gen.id, [q.gen.id for q in eng.waiting]))
        if len(preempted) == 2:
            break
    # request 2's reserve failed first, yet request 3 (the newest) was
    # preempted; then request 2, which went ahead of 3 in the queue
    assert preempted == [(3, [3]), (2, [2, 3])]
    assert [r.req.gen.id for r in eng.rows] == [1]            # the oldest keeps running
    req2, req3 = eng._reqs[2], eng._reqs[3]
    assert (req2.attempt, req2.preemptions) == (1, 1) and req3.preemptions >= 1
    # a re-run uses new table names (attempt numbers), never a stale table
    assert "w0.r3.a1.s0" in mgr.acquired


@pytest.mark.timeout(60)
def test_seeded_sampling_is_the_same_after_a_preemption(fakes):
    sampled = dict(temperature=1.0, seed=1234)
    # alone, with room: the reference tokens
    eng, mgr, _, ev = make_engine(100)
    eng.submit(gen(2, 5, max_tokens=14, **sampled))
    run_until(eng, lambda: not eng.busy)
    want = ev.tokens(2)
    assert len(want) == 14 and len(set(want)) > 3            # really sampled

    # beside an older request in a pool too small for both: preempted, re-run
    eng, mgr, _, ev = make_engine(5, max_batch=2)
    eng.submit(gen(1, 5, max_tokens=12))
    eng.submit(gen(2, 5, max_tokens=14, **sampled))
    run_until(eng, lambda: not eng.busy)
    assert eng._reqs == {} and eng.preemptions >= 1
    runs, cur = [], None                 # request 2's tokens per attempt ("admitted" starts one)
    for kind, p in ev.log:
        if kind == "admitted" and p[0] == 2:
            cur = []
            runs.append(cur)
        elif kind == "step":
            cur_tokens = [t for (i, s, t, _, _) in p if i == 2]
            if cur_tokens:
                cur.extend(cur_tokens)
    assert len(runs) >= 2                               # it ran more than once
    assert runs[-1] == want                             # the last run: every token, the same
    for r in runs[:-1]:
        assert r == want[:len(r)]                       # the cut runs: a prefix of them


@pytest.mark.timeout(60)
def test_n_samples_fork_one_prefill_of_the_prompt(fakes):
    eng, mgr, model, ev = make_engine(100)
    g = gen(5, 10, max_tokens=3, n=3, temperature=1.0, seed=9)
    eng.submit(g)
    eng.step()
    # prompt[:-1] is computed once, for sample 0's table
    prefill = [c for c in model.calls if c[0] == "prefill"]
    assert sum(c[2] for c in prefill) == 9
    assert {c[1] for c in prefill} == {"w0.r5.a0.s0"} and mgr.acquired == ["w0.r5.a0.s0"]
    # samples 1 and 2 fork it once prompt[:-1] is stored
    assert mgr.forks == [("w0.r5.a0.s0", "w0.r5.a0.s1", 9),
                         ("w0.r5.a0.s0", "w0.r5.a0.s2", 9)]
    # every sample's first token comes from the decode step that takes the
    # last prompt token in the batch: no forward pass of its own
    assert [r.sample for r in eng.rows] == [0, 1, 2]
    assert model.calls == [("prefill", "w0.r5.a0.s0", 9),
                           ("decode", ["w0.r5.a0.s0", "w0.r5.a0.s1", "w0.r5.a0.s2"])]
    assert all(len(ev.tokens(5, s)) == 1 for s in range(3))
    # the prompt's 3 blocks once, and one copy of the partly filled one per fork
    assert mgr.total - mgr.free == 3 + 2
    run_until(eng, lambda: not eng.busy)
    assert all(len(ev.tokens(5, s)) == 3 for s in range(3)) and mgr.free == mgr.total


@pytest.mark.timeout(60)
def test_a_step_computes_at_most_prefill_step_prompt_tokens_and_still_decodes(fakes):
    eng, mgr, model, ev = make_engine(100, prefill_step=10)
    assert eng.prefill_step == 8                     # rounded down to whole blocks
    assert make_engine(100, prefill_step=2)[0].prefill_step == BS    # at least one
    eng.submit(gen(1, 5, max_tokens=30))
    eng.step()
    assert len(ev.tokens(1)) == 1       # admitted; its first token from the decode step

    mgr.cached[tuple(gen(2, 31).prompt[:-1])] = 12    # a 12-token cache hit
    eng.submit(gen(3, 3, max_tokens=30))     # a short prompt first: 3 of the 8 tokens
    eng.submit(gen(2, 31, max_tokens=2))
    ends, steps = [], 0
    while not any(k == "admitted" and p[0] == 2 for k, p in ev.log):
        model.calls.clear()
        before = len(ev.tokens(1))
        eng.step()
        steps += 1
        chunks = [c[2] for c in model.calls if c[0] == "prefill"]
        assert sum(chunks) <= 8, chunks                      # the budget
        assert len(ev.tokens(1)) == before + 1              # the running row still decodes
        assert model.calls[-1][0] == "decode"
        pf = eng.prefilling
        if pf is not None:
            ends.append(pf.seq.stored)
    # from the cache-hit boundary, a chunk cut by the budget ends on a block
    # boundary (step 1 has 6 tokens left: 4 of them); then the rest of
    # prompt[:-1]: 12 -> 16 -> 24 -> 30 (the last token goes with the decode)
    assert ends == [16, 24] and steps == 3
    assert [p for k, p in ev.log if k == "progress" and p[0] == 2] == [
        (2, 12), (2, 16), (2, 24), (2, 30)]


@pytest.mark.timeout(60)
def test_a_decoding_worker_computes_at_most_decoding_prefill_step_tokens_a_step(fakes):
    """--decoding-prefill-step: with no running row a step computes up to
    ``prefill_step`` prompt tokens; a step that starts with running rows,
    up to ``decoding_prefill_step``, and the rows still get a token."""
    eng, mgr, model, ev = make_engine(200, prefill_step=16, decoding_prefill_step=6)
    assert (eng.prefill_step, eng.decoding_prefill_step) == (16, 4)    # whole blocks
    assert make_engine(100, prefill_step=8, decoding_prefill_step=64)[0] \
        .decoding_prefill_step == 8                  # never more than prefill_step
    assert make_engine(100, prefill_step=8)[0].decoding_prefill_step == 8   # the default
    eng.submit(gen(1, 21, max_tokens=30))            # idle: 16 tokens, then the 4 left
    eng.step()
    assert [c[2] for c in model.calls if c[0] == "prefill"] == [16]
    eng.step()
    assert len(ev.tokens(1)) == 1
    eng.submit(gen(2, 21, max_tokens=2))
    chunks = []
    while not any(k == "admitted" and p[0] == 2 for k, p in ev.log):
        model.calls.clear()
        before = len(ev.tokens(1))
        eng.step()
        step = [c[2] for c in model.calls if c[0] == "prefill"]
        assert sum(step) <= 4, step
        assert len(ev.tokens(1)) == before + 1       # the running row still decodes
        chunks += step
    assert chunks == [4, 4, 4, 4, 4]                 # prompt[:-1]: 20 tokens


@pytest.mark.timeout(60)
def test_cancel_during_prefill_releases_the_blocks_and_stops(fakes):
    eng, mgr, model, ev = make_engine(100, prefill_step=4)
    eng.submit(gen(1, 30))
    eng.submit(gen(2, 6))
    eng.step()
    pf = eng.prefilling
    assert pf is not None and pf.req.gen.id == 1 and pf.seq.stored == 4
    assert mgr.free == mgr.total - 1
    eng.cancel(1)
    assert eng.prefilling is None and pf.seq.released and mgr.free == mgr.total
    model.calls.clear()
    run_until(eng, lambda: not eng.busy)
    # request 1 computes nothing more and never starts; request 2 runs
    assert all(c[1] != "w0.r1.a0.s0" for c in model.calls if c[0] == "prefill")
    assert "admitted" not in ev.kinds(1) and "failed" not in ev.kinds(1)
    assert len(ev.tokens(2)) == 40 and mgr.free == mgr.total
    # a cancel of a waiting request removes it from the queue
    eng.submit(gen(3, 6))
    eng.cancel(3)
    assert not eng.busy and eng._reqs == {}


@pytest.mark.timeout(60)
def test_requests_starting_together_share_one_prefill_and_out_of_blocks_wait_in_order(fakes):
    # 4 prompts of 5 tokens: each needs 2 blocks (prompt[:-1] and its first
    # decode slot); 7 blocks hold 3 of them
    eng, mgr, model, ev = make_engine(7, max_batch=8)
    for rid in (1, 2, 3, 4):
        eng.submit(gen(rid, 5, max_tokens=3))
    eng.step()
    # three prefill together in one forward, then decode; the 4th waits at the head
    assert model.calls == [("batch-prefill", ["w0.r1.a0.s0", "w0.r2.a0.s0", "w0.r3.a0.s0"], 4),
                           ("decode", ["w0.r1.a0.s0", "w0.r2.a0.s0", "w0.r3.a0.s0"])]
    assert [q.gen.id for q in eng.waiting] == [4] and mgr.free == 1
    assert "failed" not in [k for k, _ in ev.log]
    run_until(eng, lambda: not eng.busy)
    assert all(len(ev.tokens(rid)) == 3 for rid in (1, 2, 3, 4)) and mgr.free == mgr.total
    # request 4 started once the first rows had finished and given back their blocks
    admitted4 = next(i for i, (k, p) in enumerate(ev.log) if k == "admitted" and p[0] == 4)
    first_end = next(i for i, (k, p) in enumerate(ev.log)
                     if k == "step" and any(reason for *_, reason, _ in p))
    assert first_end < admitted4


@pytest.mark.timeout(60)
def test_step_timing_log_names_each_part_of_a_step(fakes, tmp_path, monkeypatch):
    from workers.worker import step_timing
    monkeypatch.setattr(step_timing, "_DIR", str(tmp_path))
    eng, mgr, model, ev = make_engine(100)
    eng.submit(gen(1, 9, max_tokens=2))
    run_until(eng, lambda: not eng.busy)
    eng.close()
    (log,) = tmp_path.iterdir()
    lines = log.read_text().splitlines()
    assert len(lines) == 2                               # admission + decode, then decode
    assert "rows=0->1" in lines[0] and "_prefill_group=1:" in lines[0] \
        and "_forward_chunk=1:" in lines[0] and "_decode=1:" in lines[0]
    assert "rows=1->0" in lines[1] and "_prefill_group" not in lines[1]

"""The worker's generation engine (``workers.worker.engine.Engine``) in this
process, over a real pool and real mlx-lm models (llama, qwen2, qwen3 with
random weights: the ``lm`` fixture of ``_mlx_lm``).

* Greedy tokens equal mlx-lm's ``generate_step`` with its default
  ``prefill_step_size``, cold and warm, although the engine prefills in
  chunks of ``prefill_step`` tokens that start at the cache-hit boundary.
* Chunked prefill shares the step with decode: while a long prompt is
  computed, a running request gets one token every step, and no step
  computes more than ``prefill_step`` prompt tokens.
* A request cancelled in the middle of its prefill stops there: its table
  is deleted, the blocks it published stay cached.
* A prefill handed over (``Gen.handoff``) is computed on one engine and
  kept; another engine adopts its table (``Gen.adopt``) and decodes with
  no prompt token computed, mlx-lm's tokens; a table gone falls back to
  computing.
"""

from __future__ import annotations

import random

import pytest

from _mlx_lm import BS, lm, pools  # noqa: F401  (fixtures)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from workers.worker.engine import Engine  # noqa: E402
from workers.protocol import SamplingParams  # noqa: E402
from workers.wire import Gen  # noqa: E402

__all__ = ["lm", "pools"]


def reference(model, prompt, n):
    """mlx-lm's greedy tokens, its default prefill_step_size."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


class Events:
    def __init__(self):
        self.tokens: dict = {}
        self.admitted: dict = {}
        self.progress: list = []
        self.steps: list = []
        self.failed: list = []
        self.handoff: list = []

    def __call__(self, kind, payload):
        if kind == "step":
            self.steps.append(payload)
            for rid, sample, tok, *_ in payload:
                self.tokens.setdefault(rid, []).append(tok)
        elif kind == "admitted":
            self.admitted[payload[0]] = payload
        elif kind == "progress":
            self.progress.append(payload)
        elif kind == "failed":
            self.failed.append(payload)
        elif kind == "handoff":
            self.handoff.append(payload)


def gen(rid, prompt, max_tokens):
    return Gen(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), 1)


def run(engine, limit=10_000):
    for _ in range(limit):
        if not engine.busy:
            return
        engine.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.timeout(300)
def test_greedy_tokens_equal_mlx_lm_default_prefill_cold_and_warm(lm, pools):  # noqa: F811
    pool = pools(block_size=BS, max_blocks=512, **lm.layout)
    ev = Events()
    # prefill_step of 2 blocks: mlx-lm computes these prompts in one chunk
    eng = Engine(pool, lm.model, [], ev, prefill_step=2 * BS)
    rng = random.Random(5)
    vocab = lm.model.args.vocab_size
    shared = [rng.randrange(vocab) for _ in range(5 * BS + 3)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(k)] for k in (1, 9, 40)]
    want = [reference(lm.model, p, 12) for p in prompts]
    eng.submit(gen(1, prompts[0], 12))          # cold
    run(eng)
    for i, p in enumerate(prompts[1:], 2):      # warm, and two in one batch
        eng.submit(gen(i, p, 12))
    run(eng)
    assert ev.failed == []
    assert [ev.tokens[i] for i in (1, 2, 3)] == want
    assert ev.admitted[1][2] == 0
    assert ev.admitted[2][2] == ev.admitted[3][2] == len(shared) // BS * BS
    eng.close()


@pytest.mark.timeout(300)
def test_a_long_prefill_shares_every_step_with_running_decodes(lm, pools):  # noqa: F811
    if lm.arch != "llama":
        pytest.skip("one architecture is enough for the scheduling")
    pool = pools(block_size=BS, max_blocks=512, **lm.layout)
    ev = Events()
    eng = Engine(pool, lm.model, [], ev, prefill_step=2 * BS)
    rng = random.Random(7)
    vocab = lm.model.args.vocab_size
    short = [rng.randrange(vocab) for _ in range(10)]
    long = [rng.randrange(vocab) for _ in range(10 * BS + 5)]
    eng.submit(gen(1, short, 40))
    eng.step()
    assert len(ev.tokens[1]) == 1       # prompt[:-1] prefilled, the last token in the decode step
    eng.submit(gen(2, long, 4))
    steps = 0
    before = 0
    while 2 not in ev.admitted:
        n1 = len(ev.tokens[1])
        eng.step()
        steps += 1
        assert len(ev.tokens[1]) == n1 + 1, "the running request got no token this step"
        stored = max((s for rid, s in ev.progress if rid == 2), default=0)
        assert stored - before <= 2 * BS, "a step computed more than prefill_step tokens"
        before = stored
    assert steps >= 5                               # 165 tokens at 32 a step
    run(eng)
    assert ev.tokens[1] == reference(lm.model, short, 40)
    assert ev.tokens[2] == reference(lm.model, long, 4)
    eng.close()


@pytest.mark.timeout(300)
def test_cancel_in_the_middle_of_a_prefill_stops_it(lm, pools):  # noqa: F811
    if lm.arch != "llama":
        pytest.skip("one architecture is enough for the scheduling")
    pool = pools(block_size=BS, max_blocks=512, **lm.layout)
    ev = Events()
    eng = Engine(pool, lm.model, [], ev, prefill_step=2 * BS)
    rng = random.Random(9)
    vocab = lm.model.args.vocab_size
    long = [rng.randrange(vocab) for _ in range(10 * BS + 5)]
    eng.submit(gen(1, long, 4))
    eng.step()
    eng.step()
    assert eng.prefilling is not None and 1 not in ev.admitted
    eng.cancel(1)
    assert not eng.busy
    assert len(pool.request_tables) == 0            # its table is gone
    assert pool.get_stats().cached_blocks >= 4      # the chunks it published stay
    # a later request finds them
    eng.submit(gen(2, long, 4))
    run(eng)
    assert ev.admitted[2][2] >= 4 * BS
    assert ev.tokens[2] == reference(lm.model, long, 4)
    eng.close()


class Counting:
    """The model, recording the input shape of every forward pass."""

    def __init__(self, model):
        self.model, self.layers, self.shapes = model, model.layers, []

    def __call__(self, x, cache):
        self.shapes.append(tuple(x.shape))
        return self.model(x, cache=cache)


@pytest.mark.timeout(300)
def test_requests_admitted_together_share_one_prefill_forward(lm, pools):  # noqa: F811
    """Requests that start in one step (warm ones with different cache hits
    and chunk lengths, a cold one, a fully cached one) prefill in ONE batch
    forward beside a running request, and their greedy tokens still equal
    mlx-lm's generate_step, as the running request's do."""
    pool = pools(block_size=BS, max_blocks=512, **lm.layout)
    ev = Events()
    model = Counting(lm.model)
    eng = Engine(pool, model, [], ev, prefill_step=8 * BS)
    rng = random.Random(11)
    vocab = lm.model.args.vocab_size
    shared = [rng.randrange(vocab) for _ in range(4 * BS)]
    first = shared + [rng.randrange(vocab) for _ in range(2 * BS + 1)]
    eng.submit(gen(1, first, 30))                # caches shared + 2 blocks, keeps decoding
    eng.step()
    prompts = {2: shared + [rng.randrange(vocab) for _ in range(5)],          # 4 to compute
               3: first[:-1] + [rng.randrange(vocab) for _ in range(20)],     # 19
               4: [rng.randrange(vocab) for _ in range(13)],                  # cold: 12
               5: first[:-1] + [rng.randrange(vocab)]}                        # all cached
    want = {i: reference(lm.model, p, 8) for i, p in prompts.items()}
    for i, p in prompts.items():
        eng.submit(gen(i, p, 8))
    model.shapes.clear()
    n1 = len(ev.tokens[1])
    eng.step()
    # one prefill forward of 3 rows x the longest chunk, then the decode step
    assert model.shapes == [(3, 19), (5, 1)], model.shapes
    assert len(ev.tokens[1]) == n1 + 1
    assert all(i in ev.admitted for i in prompts)
    assert [ev.admitted[i][2] for i in (2, 3, 4, 5)] == [4 * BS, 6 * BS, 0, 6 * BS]
    run(eng)
    assert ev.failed == []
    assert {i: ev.tokens[i] for i in prompts} == want
    assert ev.tokens[1] == reference(lm.model, first, 30)
    eng.close()


@pytest.mark.timeout(300)
def test_handed_over_prefills_admitted_together_share_one_forward(lm, pools):  # noqa: F811
    """Two handed-over prefills and a request of its own start in one step
    beside a running request: ONE prefill forward of 3 rows, then the
    decode step of the 2 that decode here; the handed-over ones are parked
    (their whole prompt[:-1] in their tables) and join no batch, and another
    engine adopting them computes nothing and gives mlx-lm's tokens."""
    pool = pools(block_size=BS, max_blocks=512, **lm.layout)
    ev, ev_b = Events(), Events()
    model = Counting(lm.model)
    eng = Engine(pool, model, [], ev, worker_id=0, prefill_step=8 * BS)
    model_b = Counting(lm.model)
    eng_b = Engine(pool, model_b, [], ev_b, worker_id=1, prefill_step=8 * BS)
    rng = random.Random(17)
    vocab = lm.model.args.vocab_size
    shared = [rng.randrange(vocab) for _ in range(3 * BS)]
    running = shared + [rng.randrange(vocab) for _ in range(5)]
    eng.submit(gen(1, running, 30))
    eng.step()
    prompts = {2: shared + [rng.randrange(vocab) for _ in range(21)],     # 20 to compute
               3: [rng.randrange(vocab) for _ in range(9)],               # cold: 8
               4: shared + [rng.randrange(vocab) for _ in range(12)]}     # 11
    want = {i: reference(lm.model, p, 8) for i, p in prompts.items()}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for i in (2, 3):
        eng.submit(Gen(i, list(prompts[i]), params, i, handoff=True))
    eng.submit(gen(4, prompts[4], 8))
    model.shapes.clear()
    eng.step()
    assert model.shapes == [(3, 20), (2, 1)], model.shapes
    assert sorted(h[0] for h in ev.handoff) == [2, 3] and 2 not in ev.admitted
    for rid, table, stored, cached in ev.handoff:
        assert stored == len(prompts[rid]) - 1
        assert pool.get_block_table(table).num_tokens == stored
    run(eng)
    assert ev.failed == [] and ev.tokens[4] == want[4]
    assert ev.tokens[1] == reference(lm.model, running, 30)
    for rid, table, *_ in ev.handoff:
        eng_b.submit(Gen(rid, list(prompts[rid]), params, rid, adopt=table))
    model_b.shapes.clear()
    run(eng_b)
    assert ev_b.failed == [] and all(t == 1 for _, t in model_b.shapes), model_b.shapes
    assert {i: ev_b.tokens[i] for i in (2, 3)} == {2: want[2], 3: want[3]}
    for rid, *_ in list(ev.handoff):
        eng.unpark(rid)
    eng.close()
    eng_b.close()
    assert len(pool.request_tables) == 0


@pytest.mark.timeout(300)
def test_a_handed_over_prefill_is_decoded_by_another_engine_computing_nothing(lm, pools):  # noqa: F811
    """Engine A computes a prompt for a handoff and keeps its table; engine
    B (another worker, here in this process) adopts it beside a running
    request: B's only forward passes are decode steps, and the tokens are
    mlx-lm's. Unparked, the table is gone; adopting a table that is gone
    computes the prompt instead (its published blocks from the cache);
    cancelling a parked request drops its table."""
    pool = pools(block_size=BS, max_blocks=512, **lm.layout)
    ev_a, ev_b = Events(), Events()
    eng_a = Engine(pool, lm.model, [], ev_a, worker_id=0, prefill_step=2 * BS)
    model_b = Counting(lm.model)
    eng_b = Engine(pool, model_b, [], ev_b, worker_id=1, prefill_step=2 * BS)
    rng = random.Random(13)
    vocab = lm.model.args.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(5 * BS + 3)]
    want = reference(lm.model, prompt, 10)
    params = SamplingParams(max_tokens=10, temperature=0.0)

    eng_a.submit(Gen(1, list(prompt), params, 1, handoff=True))
    run(eng_a)
    assert len(ev_a.handoff) == 1 and ev_a.tokens == {} and ev_a.admitted == {}
    rid, table, stored, cached = ev_a.handoff[0]
    assert (rid, stored, cached) == (1, len(prompt) - 1, 0)
    assert pool.get_block_table(table).num_tokens == len(prompt) - 1

    other = [rng.randrange(vocab) for _ in range(7)]
    eng_b.submit(gen(9, other, 30))              # B is decoding when the handoff arrives
    eng_b.step()
    model_b.shapes.clear()
    eng_b.submit(Gen(1, list(prompt), params, 1, adopt=table))
    run(eng_b)
    assert ev_b.failed == []
    assert all(t == 1 for _, t in model_b.shapes), model_b.shapes    # decode steps only
    assert ev_b.admitted[1][2] == len(prompt) - 1
    assert ev_b.tokens[1] == want
    assert ev_b.tokens[9] == reference(lm.model, other, 30)
    eng_a.unpark(1)
    assert pool.get_block_table(table) is None

    # the table is gone (its worker died, say): B computes the rest
    eng_b.submit(Gen(2, list(prompt), params, 1, adopt=table))
    run(eng_b)
    assert ev_b.admitted[2][2] == len(prompt) // BS * BS           # the published blocks
    assert ev_b.tokens[2] == want

    # n = 2: both samples fork the adopted table (greedy: both the reference)
    eng_a.submit(Gen(4, list(prompt), params, 1, handoff=True))
    run(eng_a)
    two = SamplingParams(max_tokens=10, temperature=0.0, n=2)
    eng_b.submit(Gen(4, list(prompt), two, 1, adopt=ev_a.handoff[-1][1]))
    run(eng_b)
    eng_a.unpark(4)
    assert ev_b.failed == [] and ev_b.admitted[4][2] == len(prompt) - 1
    got4 = {}
    for items in ev_b.steps:
        for rid, sample, tok, *_ in items:
            if rid == 4:
                got4.setdefault(sample, []).append(tok)
    assert got4 == {0: want, 1: want}

    # the worker that parked it adopts it itself (its own fork, another name)
    eng_a.submit(Gen(5, list(prompt), params, 1, handoff=True))
    run(eng_a)
    own = ev_a.handoff[-1][1]
    eng_a.submit(Gen(5, list(prompt), params, 1, adopt=own))
    run(eng_a)
    assert ev_a.failed == [] and ev_a.admitted[5][2] == len(prompt) - 1
    assert ev_a.tokens[5] == want
    eng_a.unpark(5)
    assert pool.get_block_table(own) is None

    eng_a.submit(Gen(3, list(prompt) + [1, 2, 3], params, 1, handoff=True))
    run(eng_a)
    parked = ev_a.handoff[-1][1]
    assert pool.get_block_table(parked) is not None
    eng_a.cancel(3)
    assert pool.get_block_table(parked) is None
    eng_a.close()
    eng_b.close()
    assert len(pool.request_tables) == 0

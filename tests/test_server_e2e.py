"""End-to-end tests of ``shmcache serve``'s generation (the workers'
``workers.worker.engine``): greedy tokens equal mlx-lm's, cold and warm;
requests decoded together in one batch; seeded sampling; a prompt the pool
can never hold; preemption when the pool runs short.

The server is a real subprocess with real workers (``tests/_serve_proc.py``
says how, and how it is checked and stopped). The routing between workers
and a worker's death are in ``test_server_backend.py``; stopping by signal
in ``test_server_main.py``.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from _serve_proc import BS, MODEL_NAME, Answer, Reference, got, printable, serving
from _serve_proc import model_dir, reference  # pytest fixtures

# test_server_l2.py imports the first six from here; the fixtures are listed for pyflakes
__all__ = ["BS", "MODEL_NAME", "Reference", "got", "printable", "serving",
           "model_dir", "reference"]


@pytest.fixture(scope="module")
def one_worker(model_dir):
    """One worker (so concurrent requests share its batch), a small pool."""
    with serving(model_dir, "--workers", 1, "--max-blocks", 64) as srv:
        yield srv


# -------------------------------------------------------------------- tests
@pytest.mark.timeout(300)
def test_greedy_parity_with_mlx_lm_cold_and_warm(one_worker, reference):
    client = one_worker.client()
    rng = random.Random(101)
    # 40: a partial block after two full ones; 33: prompt[:-1] is exactly 2 blocks
    for length in (40, 33):
        prompt = printable(rng, length)
        ref = reference.greedy(prompt, 24)
        for run in ("cold", "warm"):
            r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                          temperature=0)
            assert got(r) == ref, f"{run} run of a {length}-token prompt"
            assert r.usage.prompt_tokens == length
            cached = r.usage.prompt_tokens_details.cached_tokens
            if run == "cold":
                assert cached == 0
            else:
                # the full blocks of prompt[:-1] come from the pool
                assert cached == (length - 1) // BS * BS > 0


@pytest.mark.timeout(300)
def test_concurrent_requests_in_one_batch_match_mlx_lm(one_worker, reference):
    """Four requests at once on one worker: decoded together in one batch
    (continuous batching: rows of different lengths that join at different
    steps and finish at different lengths); each must still equal its own
    batch-of-one mlx-lm reference. They are streamed, to check from outside
    that all four were generating at the same time (one worker runs one
    batch), i.e. that this tested batching at all."""
    client = one_worker.client()
    rng = random.Random(202)
    jobs = [(printable(rng, n), m) for n, m in ((21, 174), (37, 190), (50, 182), (64, 198))]
    refs = [reference.greedy(p, m) for p, m in jobs]
    start = threading.Barrier(len(jobs))

    def run(job):
        prompt, max_tokens = job
        start.wait()
        parts, reasons, times, usage = [], [], [], None
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                               max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.text:
                    parts.append(c.text)
                    times.append(time.monotonic())
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        assert len(reasons) == 1 and usage is not None
        return Answer("".join(parts), usage.completion_tokens, reasons[0]), times

    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(run, jobs))
    for i, ((answer, _), ref) in enumerate(zip(results, refs)):
        # NOTE: no tolerance for batched rounding: a batched step must give
        # the batch-of-one tokens (so far it does, exactly).
        assert answer == ref, f"request {i} (prompt {len(jobs[i][0])} tokens)"
    firsts = [t[0] for _, t in results]
    lasts = [t[-1] for _, t in results]
    assert max(firsts) < min(lasts), "the four requests never ran in one batch"


@pytest.mark.timeout(300)
def test_n2_seeded_sampling_is_reproducible_and_streams_the_same(one_worker):
    client = one_worker.client()
    prompt = printable(random.Random(404), 30)
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0.8, n=2)

    def texts(r):
        assert sorted(c.index for c in r.choices) == [0, 1]
        return [got(r, i).text for i in (0, 1)]

    a = texts(client.completions.create(seed=1234, **kw))
    b = texts(client.completions.create(seed=1234, **kw))
    assert a == b, "the same seed gave different samples"
    assert a[0] != a[1], "the two samples of one request are the same"
    assert texts(client.completions.create(seed=4321, **kw)) != a, "the seed is ignored"

    parts: dict = {0: [], 1: []}
    reasons: dict = {}
    chunks = 0
    for chunk in client.completions.create(seed=1234, stream=True, **kw):
        chunks += 1
        for c in chunk.choices:
            parts[c.index].append(c.text)
            if c.finish_reason:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    assert chunks > 2                       # streamed, not one blob
    assert ["".join(parts[0]), "".join(parts[1])] == a
    assert set(reasons) == {0, 1}


@pytest.mark.timeout(300)
def test_prompt_the_pool_can_never_hold_is_a_400(one_worker, reference):
    """--max-blocks 64 (63 usable): a 64*16-token prompt cannot fit."""
    srv = one_worker
    client = srv.client()
    rng = random.Random(606)
    huge = printable(rng, 64 * BS)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=huge, max_tokens=8, temperature=0)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == "prompt"
    assert "blocks" in e.value.body["message"]

    # the raw body: OpenAI's error shape
    raw = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                     json={"model": MODEL_NAME, "prompt": huge, "max_tokens": 8})
    assert raw.status_code == 400
    body = raw.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"

    # a prompt that fits, with max_tokens that cannot: the fault is max_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=huge[:100], max_tokens=63 * BS,
                                  temperature=0)
    assert e.value.body["param"] == "max_tokens"

    # still serving, and correctly
    assert srv.get("/health").status_code == 200
    ok = printable(rng, 20)
    r = client.completions.create(model=MODEL_NAME, prompt=ok, max_tokens=16, temperature=0)
    assert got(r) == reference.greedy(ok, 16)


@pytest.mark.timeout(300)
def test_preempted_requests_still_match_mlx_lm(model_dir, reference):
    """A pool too small for four requests at once (23 usable blocks; each
    request needs 9 at its end, alone it fits): the worker preempts its
    newest request when a decode step finds no free block, re-runs it later
    from its prompt, and every answer still equals its mlx-lm reference.
    Such a pool is warned about at startup."""
    rng = random.Random(707)
    jobs = [printable(rng, 40) for _ in range(4)]
    refs = [reference.greedy(p, 100) for p in jobs]
    with serving(model_dir, "--workers", 1, "--max-blocks", 24) as srv:
        client = srv.client()
        start = threading.Barrier(len(jobs))

        def run(prompt):
            start.wait()
            return got(client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                                 max_tokens=100))

        with ThreadPoolExecutor(len(jobs)) as ex:
            answers = list(ex.map(run, jobs))
        assert answers == refs
        assert srv.metric("shmcache_preemptions_total") >= 1, "the pool never ran short"
        # the operator was told at startup that the pool holds less than one context
        assert "--max-blocks 24 holds 368 tokens, less than the model's context of 8192" \
            in srv.log()

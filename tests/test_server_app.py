"""The HTTP layer of ``shmcache serve`` (``shmcache.server.app``), alone: its
routes (completions, chat, models, health, metrics), errors from the backend,
concurrent requests, and the lifespan that starts and closes the backend.

The backend is a fake and the server runs in this process
(``tests/_fake_backend.py``); streaming and disconnects are in
``test_server_responses.py``, stop strings in ``test_server_sample_text.py``,
requests refused with a 400 in ``test_server_validation.py``, and
``shmcache serve`` itself in ``test_server_main.py``. The end-to-end tests of
the real server (``WorkerBackend``, real processes) are in
``test_server_e2e.py`` and ``test_server_backend.py``.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from shmcache.server.app import create_app
from workers.protocol import Error

from _fake_backend import (BLOCK, C, CH, MODEL, USER, FakeBackend, ServerThread, default_reply,
                           m, metrics, wait_for)
from _fake_backend import client, fake, http, served, tokenizer  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["client", "fake", "http", "served", "tokenizer"]

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------- completions
def test_completion(client, fake, tokenizer):
    r = client.completions.create(
        model=MODEL, prompt="Say hi", max_tokens=100, seed=7, temperature=0.5, top_p=0.9,
        user="someone", extra_body={"top_k": 20, "min_p": 0.1, "cache_salt": "tenant-a"})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    assert r.choices[0].text == default_reply(None, None, 0)
    assert r.choices[0].finish_reason == "stop"
    prompt = tokenizer.encode("Say hi")
    out_len = len(tokenizer.encode(default_reply(None, None, 0)))
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == out_len
    assert r.usage.total_tokens == len(prompt) + out_len
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    [call] = fake.calls
    assert call["prompt"] == prompt and call["finished"]
    p = call["params"]
    assert (p.max_tokens, p.n, p.seed, p.temperature, p.top_p, p.top_k, p.min_p, p.salt) == (
        100, 1, 7, 0.5, 0.9, 20, 0.1, "tenant-a")


def test_completion_defaults_token_prompt_and_length(client, fake, tokenizer):
    ids = tokenizer.encode("abc")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5)
    assert r.choices[0].text == default_reply(None, None, 0)[:5]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert fake.calls[0]["prompt"] == ids
    # no model, no max_tokens: OpenAI's defaults (16 tokens, temperature 1)
    with httpx.Client() as h:
        r = h.post(str(client.base_url) + "completions", json={"prompt": "x"})
    assert r.status_code == 200, r.text
    p = fake.calls[1]["params"]
    assert (p.max_tokens, p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.salt) == (
        16, 1, 1.0, 1.0, 0, 0.0, None, None)
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_completion_n2(client, fake):
    r = client.completions.create(model=MODEL, prompt="p", n=2, max_tokens=200)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert c.text == default_reply(None, None, c.index)
        assert c.finish_reason == "stop"
    assert fake.calls[0]["params"].n == 2


def test_eos_token_is_not_text(client, fake, tokenizer):
    fake.append_eos = True
    r = client.completions.create(model=MODEL, prompt="p", max_tokens=200)
    assert r.choices[0].text == default_reply(None, None, 0)
    assert r.usage.completion_tokens == len(tokenizer.encode(default_reply(None, None, 0))) + 1


# ------------------------------------------------------------------- chat
def test_chat(client, fake, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=300,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content == default_reply(None, None, 0)
    assert c.finish_reason == "stop"
    expect = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        add_generation_prompt=True)
    assert fake.calls[0]["prompt"] == expect
    assert r.usage.prompt_tokens == len(expect)
    p = fake.calls[0]["params"]
    assert p.max_tokens == 300 and p.temperature == 0.0


# ------------------------------------------------------------ prefix cache
def test_cached_tokens(client, fake):
    prompt = "a long shared system prompt, then a question"
    r1 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    r2 = client.completions.create(model=MODEL, prompt=prompt + "?", max_tokens=2)
    r3 = client.completions.create(model=MODEL, prompt=prompt + "?", max_tokens=2,
                                   extra_body={"cache_salt": "other-tenant"})
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == len(prompt) // BLOCK * BLOCK > 0
    assert r3.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model=MODEL, prompt=prompt + "!", max_tokens=2,
                                       stream=True, stream_options={"include_usage": True})
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens > 0


# ------------------------------------------------------ errors from backend
def test_backend_error_non_streamed(http, fake):
    fake.error, fake.error_after = Error("worker crashed twice", 500), 1
    r = http.post(C, json={"prompt": "x", "max_tokens": 50})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "worker crashed twice"
    assert r.json()["error"]["type"] == "server_error"
    fake.error, fake.error_after = Error("too long for any worker", 400), 0
    r = http.post(CH, json={"messages": USER})
    assert r.status_code == 400 and r.json()["error"]["message"] == "too long for any worker"


def test_backend_error_streamed(client, fake):
    fake.error, fake.error_after = Error("worker crashed twice", 500), 2
    fake.chunk = 1
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=50, stream=True)
    got = []
    with pytest.raises(openai.APIError) as ei:
        for c in stream:
            got.append(c.choices[0].text)
    assert "worker crashed twice" in str(ei.value)
    assert "".join(got) == "He"
    # an Error before Started: the stream has not begun, so it is a plain error response
    fake.reset()
    fake.error_first = Error("no worker can take it", 503)
    with pytest.raises(openai.APIStatusError) as ei:
        client.completions.create(model=MODEL, prompt="x", stream=True)
    assert ei.value.status_code == 503 and "no worker can take it" in str(ei.value)


def test_backend_exception_and_bad_event(http, client, fake):
    fake.boom = RuntimeError("kaboom")
    r = http.post(C, json={"prompt": "x"})
    assert r.status_code == 500 and "kaboom" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError) as ei:
        list(client.completions.create(model=MODEL, prompt="x", stream=True))
    assert "kaboom" in str(ei.value)
    fake.reset()
    fake.bad_sample = True
    r = http.post(CH, json={"messages": USER, "n": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert fake.calls[0]["closed"] == "aclose"
    # the server carries on
    fake.reset()
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == "H"


def test_concurrent_requests_do_not_mix(client, fake, tokenizer):
    from concurrent.futures import ThreadPoolExecutor
    fake.reply = lambda p, s, i: f"<{tokenizer.decode(p)}:{i}>"
    fake.delay = 0.002

    def one(k):
        if k % 2:
            out = {}
            for c in client.completions.create(model=MODEL, prompt=f"req{k}", n=2,
                                               max_tokens=50, stream=True):
                out[c.choices[0].index] = out.get(c.choices[0].index, "") + c.choices[0].text
            return [out[0], out[1]]
        r = client.completions.create(model=MODEL, prompt=f"req{k}", n=2, max_tokens=50)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(16)))
    assert results == [[f"<req{k}:0>", f"<req{k}:1>"] for k in range(16)]


# ---------------------------------------------- models, health, metrics
def test_models(client, http):
    models = client.models.list()
    assert [m_.id for m_ in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = http.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert http.get("/no/such/path").status_code == 404


def test_health(http, fake):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "workers_alive": 2}
    fake.workers_alive = 0
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["workers_alive"] == 0


def test_metrics_move(client, http, fake, tokenizer):
    before = metrics(http)
    prompt = "the same prompt, twice over"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert len(list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                              stream=True))) >= 2
    wait_for(lambda: m(metrics(http), "shmcache_requests_running") == 0)
    after = metrics(http)
    n = len(tokenizer.encode(prompt))
    cached = (n - 1) // BLOCK * BLOCK

    def d(name, **labels):
        return m(after, name, **labels) - m(before, name, **labels)

    assert d("shmcache_requests_total", endpoint=C, status="200") >= 1
    assert d("shmcache_prompt_tokens_total") == 2 * n
    assert d("shmcache_cached_prompt_tokens_total") == cached
    assert d("shmcache_generation_tokens_total") >= 4
    assert d("shmcache_time_to_first_token_seconds_count") == 2
    assert d("shmcache_time_to_first_token_seconds_sum") > 0
    assert m(after, "shmcache_time_to_first_token_seconds_bucket", le="+Inf") == \
        m(after, "shmcache_time_to_first_token_seconds_count")
    rate = m(after, "shmcache_prefix_cache_hit_rate")
    assert rate == pytest.approx(m(after, "shmcache_cached_prompt_tokens_total")
                                 / m(after, "shmcache_prompt_tokens_total"))
    assert 0 < rate < 1
    for name, v in (("shmcache_pool_blocks_total", 100), ("shmcache_pool_blocks_used", 7),
                    ("shmcache_pool_blocks_free", 60), ("shmcache_pool_blocks_cached", 33),
                    ("shmcache_preemptions_total", 3), ("shmcache_worker_restarts_total", 1),
                    ("shmcache_workers_alive", 2)):
        assert m(after, name) == v, name
    fake.workers_alive = 1
    assert m(metrics(http), "shmcache_workers_alive") == 1


# ----------------------------------------------------------------- lifespan
def test_lifespan_starts_and_closes_backend(tokenizer):
    backend = FakeBackend(tokenizer)
    ready = []
    app = create_app(backend, served_model_name="my-model", on_ready=lambda: ready.append(1))
    with ServerThread(app) as s:
        assert backend.started and not backend.closed and ready == [1]
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
        assert [x.id for x in c.models.list().data] == ["my-model"]
        # requests may name the served name or the backend's model id
        assert c.completions.create(model="my-model", prompt="x", max_tokens=1).model == "my-model"
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == "H"
    assert backend.closed

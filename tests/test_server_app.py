"""The HTTP layer of ``shmcache serve`` (``shmcache.server.app``), alone.

This is a unit test of the HTTP layer only: the backend is a FAKE written
here (no worker processes, no pool, no model), which replays scripted text as
token ids and records what it was asked and whether it was closed. The
end-to-end tests of the real server (``WorkerBackend``, real processes) live
elsewhere.

What is real: the tokenizer (the demo model's byte-level tokenizer, built in
a temporary directory and loaded by ``mlx_lm``, so a multi-byte character
spans several tokens), uvicorn serving the app on 127.0.0.1 in a
background thread, the official ``openai`` client, and raw ``httpx`` for the
error cases and disconnects.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from shmcache.server.app import create_app
from shmcache.server.protocol import Error, SampleDone, Started, Tokens

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-model"
BLOCK = 4                        # the fake's prefix-cache granularity


def build_tokenizer(path: Path):
    """The demo model's tokenizer (one token per byte, special tokens, a chat
    template; mlx_lm streams it with its NaiveStreamingDetokenizer), from a
    tiny ``shmcache.demo_model`` directory: only its tokenizer is used here."""
    from shmcache.demo_model import build_model_dir
    build_model_dir(path, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return load_tokenizer(path)


def load_tokenizer(path: Path):
    """As ``mlx_lm.load`` loads a model directory's tokenizer."""
    from mlx_lm.tokenizer_utils import load
    eos = json.loads((Path(path) / "config.json").read_text()).get("eos_token_id")
    return load(Path(path), eos_token_ids=eos)


def default_reply(prompt, params, sample) -> str:
    return f"Hello world {sample}! café ☕ naïve end."


class FakeBackend:
    """Duck-types ``shmcache.server.api.Backend``. ``generate`` replays
    ``reply(prompt, params, sample)`` as byte tokens, ``chunk`` tokens per
    ``Tokens`` event, samples interleaved; stops at ``max_tokens``
    ("length") or at the end of the text ("stop"). Knobs: ``hang_after``
    (events, then wait forever), ``error``/``error_after`` (an ``Error``
    event), ``append_eos``, ``capacity`` (what ``admission_error`` allows).
    Each call is recorded in ``calls`` with how its generator ended."""

    model_id = MODEL
    max_n = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.started = self.closed = False
        self.reset()

    def reset(self):
        self.calls = []
        self.reply = default_reply
        self.chunk = 2
        self.delay = 0.0
        self.hang_after = None
        self.error = None
        self.error_after = 0
        self.error_first = None              # an Error instead of Started
        self.boom = None                     # an exception raised after Started
        self.bad_sample = False              # Tokens for a sample that does not exist
        self.append_eos = False
        self.capacity = 10_000
        self.seen = []                       # (salt, prompt) of earlier requests
        self.workers_alive = 2

    # ----------------------------------------------------------- Backend
    def admission_error(self, prompt_tokens, max_tokens, n):
        need = prompt_tokens + n * max_tokens
        if need > self.capacity:
            return f"the request needs {need} tokens of KV cache; the pool holds {self.capacity}"
        return None

    def stats(self):
        return {"blocks_total": 100, "blocks_used": 7, "blocks_free": 60, "blocks_cached": 33,
                "preemptions": 3, "worker_restarts": 1, "workers_alive": self.workers_alive}

    async def start(self):
        self.started = True

    async def close(self):
        self.closed = True

    def _cached(self, prompt, salt) -> int:
        best = 0
        for s, p in self.seen:
            if s != salt:
                continue
            k = 0
            while k < min(len(p), len(prompt) - 1) and p[k] == prompt[k]:
                k += 1
            best = max(best, k // BLOCK * BLOCK)
        self.seen.append((salt, list(prompt)))
        return best

    async def generate(self, prompt, params):
        rec = {"prompt": list(prompt), "params": params, "finished": False, "closed": None}
        self.calls.append(rec)
        try:
            if self.error_first is not None:
                yield self.error_first
                return
            yield Started(prompt_tokens=len(prompt),
                          cached_tokens=self._cached(prompt, params.salt), worker=0)
            if self.boom is not None:
                raise self.boom
            if self.bad_sample:
                yield Tokens(sample=params.n, token_ids=[1])
            outs, reasons = [], []
            for i in range(params.n):
                ids = self.tokenizer.encode(self.reply(prompt, params, i))
                if self.append_eos:
                    ids = ids + [self.tokenizer.eos_token_id]
                reasons.append("length" if len(ids) > params.max_tokens else "stop")
                outs.append(ids[:params.max_tokens])
            pos = [0] * params.n
            events = 0
            while any(p <= len(o) for p, o in zip(pos, outs)):
                for i, o in enumerate(outs):
                    if pos[i] > len(o):
                        continue
                    if self.error is not None and events == self.error_after:
                        yield self.error
                        return
                    if self.hang_after is not None and events >= self.hang_after:
                        await asyncio.Event().wait()
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    if pos[i] == len(o):
                        pos[i] += 1
                        # the HTTP layer may close us at this last yield
                        rec["finished"] = all(p > len(o) for p, o in zip(pos, outs))
                        yield SampleDone(sample=i, reason=reasons[i])
                    else:
                        yield Tokens(sample=i, token_ids=o[pos[i]:pos[i] + self.chunk])
                        pos[i] += self.chunk
                        pos[i] = min(pos[i], len(o))
                    events += 1
        except GeneratorExit:
            rec["closed"] = "aclose"
            raise
        except asyncio.CancelledError:
            rec["closed"] = "cancelled"
            raise


# ------------------------------------------------------------------ server
class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1, a free port, in a daemon thread."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not stop"
        self.sock.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def served(tokenizer):
    backend = FakeBackend(tokenizer)
    with ServerThread(create_app(backend)) as s:
        s.backend = backend
        yield s


@pytest.fixture
def fake(served):
    served.backend.reset()
    return served.backend


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        yield c


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def metrics(http) -> dict:
    """{(sample name, frozenset(labels)): value} of /metrics."""
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def m(snap, name, **labels) -> float:
    return snap.get((name, frozenset(labels.items())), 0.0)


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


def test_chat_max_tokens_and_default_capped_by_pool(client, fake):
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    assert fake.calls[-1]["params"].max_tokens == 4
    # no length given: the default (512), lowered to what the pool can hold
    client.chat.completions.create(model=MODEL, messages=msgs)
    assert fake.calls[-1]["params"].max_tokens == 512
    fake.capacity = len(fake.calls[-1]["prompt"]) + 2 * 100
    client.chat.completions.create(model=MODEL, messages=msgs, n=2)
    assert fake.calls[-1]["params"].max_tokens == 100


# -------------------------------------------------------------- streaming
def test_stream_completion_with_usage(client, fake, tokenizer):
    fake.chunk = 1                  # one byte per event: multi-byte characters span events
    stream = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=200, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    texts = [c.choices[0].text for c in chunks[:-1]]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == default_reply(None, None, 0)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    u = chunks[-1].usage
    assert u.prompt_tokens == len(tokenizer.encode("Say hi"))
    assert u.completion_tokens == len(tokenizer.encode(default_reply(None, None, 0)))
    assert fake.calls[0]["finished"]


def test_stream_chat_n2(client, fake):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, stream=True,
        max_completion_tokens=200)
    text, reasons, roles = {0: "", 1: ""}, {}, set()
    for c in stream:
        assert c.object == "chat.completion.chunk"
        assert c.usage is None
        for ch in c.choices:
            if ch.delta.role:
                roles.add(ch.index)
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert roles == {0, 1}
    assert text == {0: default_reply(None, None, 0), 1: default_reply(None, None, 1)}
    assert reasons == {0: "stop", 1: "stop"}


def test_stream_raw_sse(http, fake):
    with http.stream("POST", "/v1/completions",
                     json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last


# ----------------------------------------------------------- stop strings
def test_stop_string(client, fake):
    fake.reply = lambda p, s, i: "Hello, world! Goodbye, world!"
    r = client.completions.create(model=MODEL, prompt="p", max_tokens=100, stop="world")
    assert r.choices[0].text == "Hello, "
    assert r.choices[0].finish_reason == "stop"
    # the generator was closed once the only sample stopped
    assert not fake.calls[0]["finished"] and fake.calls[0]["closed"] == "aclose"
    assert r.usage.completion_tokens == len("Hello, world")   # up to the token ending "world"


def test_stop_earliest_of_several_and_streamed_across_chunks(client, fake):
    fake.reply = lambda p, s, i: "one two three four"
    for chunk in (1, 2, 3):
        fake.chunk = chunk
        r = client.completions.create(model=MODEL, prompt="p", max_tokens=100,
                                      stop=["four", "o thr"])
        assert r.choices[0].text == "one tw"
        stream = client.completions.create(model=MODEL, prompt="p", max_tokens=100,
                                           stop=["four", "o thr"], stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == "one tw"
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_prefix_held_back_then_released(client, fake):
    fake.reply = lambda p, s, i: "ab ab abc"
    fake.chunk = 1
    stream = client.completions.create(model=MODEL, prompt="p", max_tokens=100, stop=["abd"],
                                       stream=True)
    texts = [c.choices[0].text for c in stream]
    assert "".join(texts) == "ab ab abc"
    # "ab" is never sent before the character that rules "abd" out
    assert not any(t.endswith("ab") for t in texts)
    assert fake.calls[0]["finished"]


def test_stop_multibyte_and_chat(client, fake):
    fake.reply = lambda p, s, i: "naïve café ☕ more"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       stop=["☕"], max_tokens=100)
    assert r.choices[0].message.content == "naïve café "
    assert r.choices[0].finish_reason == "stop"


def test_stop_n2_closes_when_all_stopped(client, fake):
    fake.reply = lambda p, s, i: f"sample {i} says STOP and goes on for a while"
    r = client.completions.create(model=MODEL, prompt="p", n=2, max_tokens=100, stop="STOP")
    assert sorted(c.text for c in r.choices) == ["sample 0 says ", "sample 1 says "]
    assert {c.finish_reason for c in r.choices} == {"stop"}
    assert fake.calls[0]["closed"] == "aclose"


@pytest.mark.parametrize("detok", ["NaiveStreamingDetokenizer", "BPEStreamingDetokenizer"])
def test_sample_text_with_either_detokenizer(tokenizer, detok):
    """The per-sample text logic (``app._Sample``) with both streaming
    detokenizers mlx_lm picks for byte-level tokenizers, one token at a time."""
    import mlx_lm.tokenizer_utils as tu

    from shmcache.server.app import _Sample
    wrapper = tu.TokenizerWrapper(tokenizer._tokenizer, getattr(tu, detok),
                                  eos_token_ids=tokenizer.eos_token_ids)
    text = "naïve café ☕ — ünïcödé, then STOP here"
    ids = wrapper.encode(text)
    for stops, expect, reason in (([], text, "length"),
                                  (["STOP"], text[:text.index("STOP")], "stop"),
                                  (["é,", "☕ —"], "naïve café ", "stop"),
                                  (["STOX"], text, "length")):
        s = _Sample(wrapper, stops, frozenset(wrapper.eos_token_ids))
        parts = []
        for t in ids + [tokenizer.eos_token_id]:
            if s.done:
                break
            parts.append(s.add([t]))
        if not s.done:
            parts.append(s.finish("length"))
        assert all("\ufffd" not in p for p in parts)
        assert "".join(parts) == expect and s.reason == reason, (stops, parts)


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


# ------------------------------------------------------- bad requests: 400
C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [
    # (id, path, body (bytes: sent raw), param, words in the message)
    ("malformed-json", C, b'{"prompt": "x",', None, ["JSON"]),
    ("empty-body", C, b"", None, ["JSON"]),
    ("not-an-object", C, [1, 2], None, ["object"]),
    ("missing-prompt", C, {"model": MODEL}, "prompt", ["prompt"]),
    ("missing-messages", CH, {"model": MODEL}, "messages", ["messages"]),
    ("prompt-wrong-type", C, {"prompt": 5}, "prompt", ["prompt"]),
    ("prompt-batch", C, {"prompt": ["a", "b"]}, "prompt", ["batch"]),
    ("prompt-bool-ids", C, {"prompt": [1, True]}, "prompt", ["token ids"]),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "5"}, "max_tokens", ["max_tokens"]),
    ("max-tokens-float", C, {"prompt": "x", "max_tokens": 1.5}, "max_tokens", ["max_tokens"]),
    ("stream-string", C, {"prompt": "x", "stream": "yes"}, "stream", ["stream"]),
    ("unknown-model", C, {"prompt": "x", "model": "gpt-4"}, "model", ["gpt-4", MODEL]),
    ("max-tokens-0", C, {"prompt": "x", "max_tokens": 0}, "max_tokens", ["max_tokens"]),
    ("max-completion-tokens-0", CH, {"messages": USER, "max_completion_tokens": 0},
     "max_completion_tokens", ["max_completion_tokens"]),
    ("empty-prompt", C, {"prompt": ""}, "prompt", ["empty"]),
    ("empty-prompt-ids", C, {"prompt": []}, "prompt", ["empty"]),
    ("empty-messages", CH, {"messages": []}, "messages", ["empty"]),
    ("n-0", C, {"prompt": "x", "n": 0}, "n", ["n"]),
    ("n-too-big", C, {"prompt": "x", "n": 5}, "n", ["maximum", "4"]),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.1}, "temperature",
     ["temperature"]),
    ("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', "temperature",
     ["finite"]),
    ("top-p-0", CH, {"messages": USER, "top_p": 0}, "top_p", ["top_p"]),
    ("top-p-above-1", C, {"prompt": "x", "top_p": 1.5}, "top_p", ["top_p"]),
    ("min-p-above-1", C, {"prompt": "x", "min_p": 2}, "min_p", ["min_p"]),
    ("top-k-below-minus-1", C, {"prompt": "x", "top_k": -2}, "top_k", ["top_k"]),
    ("seed-negative", C, {"prompt": "x", "seed": -1}, "seed", ["seed"]),
    ("stop-wrong-type", C, {"prompt": "x", "stop": 5}, "stop", ["stop"]),
    ("token-id-outside-vocab", C, {"prompt": [1, 99999]}, "prompt", ["99999", "vocabulary"]),
    ("stop-token-id-outside-vocab", C, {"prompt": "x", "stop_token_ids": [-1]},
     "stop_token_ids", ["-1"]),
    ("bad-role", CH, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role",
     ["role"]),
    ("image-content", CH, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content",
     ["text"]),
    ("user-without-content", CH, {"messages": [{"role": "user"}]}, "messages[0].content",
     ["content"]),
    ("empty-cache-salt", C, {"prompt": "x", "cache_salt": ""}, "cache_salt", ["cache_salt"]),
    ("logprobs", C, {"prompt": "x", "logprobs": 2}, "logprobs", ["not supported"]),
    ("tools", CH, {"messages": USER, "tools": [{"type": "function"}]}, "tools",
     ["not supported"]),
    ("penalty", C, {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty",
     ["not supported"]),
    ("pool-never-holds-max-tokens", C, {"prompt": "x", "max_tokens": 20000}, "max_tokens",
     ["20001", "pool"]),
    ("pool-never-holds-n", C, {"prompt": "x" * 9000, "max_tokens": 600, "n": 2}, "n",
     ["pool"]),
    ("pool-never-holds-prompt", C, {"prompt": "x" * 10001}, "prompt", ["pool"]),
    ("pool-never-holds-chat", CH, {"messages": [{"role": "user", "content": "x" * 10001}]},
     "messages", ["pool"]),
    ("stream-pool-never-holds", CH, {"messages": USER, "stream": True, "max_tokens": 99999},
     "max_tokens", ["pool"]),
]


@pytest.mark.parametrize("path,body,param,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_400(http, fake, path, body, param, words):
    before = metrics(http)
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(r.json()) == {"error"}
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] is None
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    assert fake.calls == []                     # the backend was never asked
    after = metrics(http)
    assert m(after, "shmcache_requests_total", endpoint=path, status="400") == \
        m(before, "shmcache_requests_total", endpoint=path, status="400") + 1
    # and nothing else is affected
    ok = http.post(C, json={"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "He"


def test_openai_client_sees_bad_request(client, fake):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="nope", prompt="x")
    assert ei.value.status_code == 400 and ei.value.param == "model"
    assert fake.calls == []


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


# ---------------------------------------------------------- disconnects
def test_client_disconnect_mid_stream_closes_generator(served, fake):
    fake.hang_after = 3
    with httpx.Client(base_url=served.url, timeout=30) as h:
        with h.stream("POST", CH, json={"messages": USER, "stream": True,
                                        "max_tokens": 100}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["object"] == "chat.completion.chunk"
        # leaving the block closes the connection mid-stream
    wait_for(lambda: fake.calls and fake.calls[0]["closed"] is not None)
    assert not fake.calls[0]["finished"]
    assert fake.calls[0]["closed"] in ("aclose", "cancelled")
    with httpx.Client(base_url=served.url, timeout=30) as h:
        wait_for(lambda: m(metrics(h), "shmcache_requests_total", endpoint=CH, status="499") >= 1)
        assert m(metrics(h), "shmcache_requests_running") == 0


def test_client_disconnect_non_streamed_closes_generator(served, fake):
    fake.hang_after = 1
    with httpx.Client(base_url=served.url, timeout=1.0) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post(C, json={"prompt": "x", "max_tokens": 100})
    wait_for(lambda: fake.calls and fake.calls[0]["closed"] is not None)
    assert fake.calls[0]["closed"] == "cancelled"


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


# ------------------------------------------------- `shmcache serve` (main.py)
SERVE_SCRIPT = r"""
import os, sys, types
import shmcache                            # before mlx (it sets up BLAS)
from pathlib import Path
sys.path.insert(0, os.environ["TESTS_DIR"])
from test_server_app import FakeBackend, load_tokenizer

class WorkerBackend(FakeBackend):          # stands in for the real one: same constructor
    def __init__(self, model, workers, max_blocks, block_size, **options):
        super().__init__(load_tokenizer(Path(model)))
        self.log(f"built workers={workers} max_blocks={max_blocks} block_size={block_size}")
        self.hang_after = int(os.environ.get("HANG_AFTER", "-1"))
        if self.hang_after < 0:
            self.hang_after = None
    def log(self, line):
        with open(os.environ["MARKER"], "a") as f:
            f.write(line + "\n")
    async def start(self):
        self.log("started")
    async def close(self):
        self.log("closed")

mod = types.ModuleType("shmcache.server.backend")
mod.WorkerBackend = WorkerBackend
sys.modules["shmcache.server.backend"] = mod
from shmcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_serve(tmp_path, tokenizer_dir, *args, hang_after=None):
    import os
    import subprocess
    import sys
    marker = tmp_path / "marker"
    env = dict(os.environ, TESTS_DIR=str(Path(__file__).parent), MARKER=str(marker),
               HANG_AFTER=str(-1 if hang_after is None else hang_after))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, "serve", "--model", str(tokenizer_dir), *args],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    return proc, marker


def read_url(proc) -> tuple[str, list]:
    import re
    lines = []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"shmcache serve: .* on (http://127\.0\.0\.1:\d+) ", line)
        if found:
            return found.group(1), lines
    raise AssertionError("no startup line:\n" + "".join(lines))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-tokenizer")
    build_tokenizer(d)
    return d


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_serve_runs_and_stops_on_signal(tmp_path, tokenizer_dir, sig):
    import signal
    proc, marker = start_serve(tmp_path, tokenizer_dir, "--port", "0", "--workers", "3",
                               "--block-size", "8", "--max-blocks", "64")
    try:
        url, lines = read_url(proc)
        assert len(lines) == 1, lines                  # one startup line, with the URL
        assert marker.read_text().splitlines() == [
            "built workers=3 max_blocks=64 block_size=8", "started"]
        with httpx.Client(base_url=url, timeout=30) as h:
            assert h.get("/health").status_code == 200
            r = h.post(C, json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(20) == 0
        assert marker.read_text().splitlines()[-1] == "closed"
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_serve_stops_with_a_stream_in_flight(tmp_path, tokenizer_dir):
    import signal
    proc, marker = start_serve(tmp_path, tokenizer_dir, "--port", "0", hang_after=2)
    try:
        url, _ = read_url(proc)
        with httpx.Client(base_url=url, timeout=30) as h:
            with h.stream("POST", C, json={"prompt": "x", "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                # after the grace period the server cuts the stream off
                with pytest.raises(httpx.RemoteProtocolError):
                    list(lines)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 20
        assert marker.read_text().splitlines()[-1] == "closed"
    finally:
        proc.kill()
        proc.wait()


def test_serve_port_in_use(tmp_path, tokenizer_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc, marker = start_serve(tmp_path, tokenizer_dir, "--port",
                                   str(busy.getsockname()[1]))
        try:
            assert proc.wait(30) == 2
            err = proc.stderr.read().strip().splitlines()
        finally:
            proc.kill()
            proc.wait()
    assert len(err) == 1 and err[0].startswith("shmcache serve: error: cannot listen on"), err
    assert not marker.exists()                       # failed before building the backend

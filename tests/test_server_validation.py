"""The checks a request goes through before the backend is asked
(``shmcache.server.openai_types`` and ``shmcache.server.validation``): every
bad request is a 400 in OpenAI's error shape, and a length the client left
out is lowered to what the pool can hold.

The backend is a fake and the server runs in this process
(``tests/_fake_backend.py``).
"""

from __future__ import annotations

import openai
import pytest

from _fake_backend import C, CH, MODEL, USER, m, metrics
from _fake_backend import client, fake, http, served, tokenizer  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["client", "fake", "http", "served", "tokenizer"]

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------- lengths the pool can hold
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


# ------------------------------------------------------- bad requests: 400
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

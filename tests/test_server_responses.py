"""How ``shmcache serve`` writes a generation out (``shmcache.server.responses``):
server-sent event streams, and a client that disconnects (the backend's
generator is closed, the request counted as 499).

The backend is a fake and the server runs in this process
(``tests/_fake_backend.py``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from _fake_backend import C, CH, MODEL, USER, default_reply, m, metrics, wait_for
from _fake_backend import client, fake, http, served, tokenizer  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["client", "fake", "http", "served", "tokenizer"]

pytestmark = pytest.mark.timeout(60)


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

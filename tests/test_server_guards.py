"""The HTTP layer's guards (``shmcache.server.app``), with the fake backend
of ``tests/_fake_backend.py`` (a unit test of the HTTP layer: no workers):
the body limit (413), OpenAI-shaped 404/405, a lone surrogate and ``top_k``
above the vocabulary (400), the model's context length and
``max_prompt_tokens`` (400 before the backend is called), ``api_key`` (401;
``/health`` open), CORS, and a large body tokenized off the event loop.

The same guards through the real ``shmcache serve`` are in
``test_server_front.py``.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from shmcache.server.app import create_app

from _fake_backend import C, CH, FakeBackend, ServerThread, build_tokenizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _serve(tokenizer, **kw):
    backend = FakeBackend(tokenizer)
    backend.context_length = kw.pop("context_length", None)
    s = ServerThread(create_app(backend, **kw))
    s.backend = backend
    return s


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


def test_body_limit_is_a_413_and_the_backend_is_not_called(tokenizer):
    with _serve(tokenizer, max_body_bytes=1000) as s, httpx.Client(base_url=s.url) as h:
        e = _err(h.post(C, json={"prompt": "x" * 2000, "max_tokens": 1}), 413)
        assert "1000 bytes" in e["message"] and "--max-body-bytes" in e["message"]
        # chunked (no Content-Length): cut off while reading
        def gen():
            for _ in range(20):
                yield b" " * 100
        e = _err(h.post(C, content=gen(), headers={"content-type": "application/json"}), 413)
        assert s.backend.calls == []
        assert h.post(C, json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_404_and_405_have_openai_bodies(tokenizer):
    with _serve(tokenizer) as s, httpx.Client(base_url=s.url) as h:
        e = _err(h.get("/v1/nothing"), 404)
        assert e["type"] == "invalid_request_error" and "/v1/nothing" in e["message"]
        e = _err(h.get(C), 405)
        assert "GET" in e["message"]


def test_lone_surrogate_and_top_k_above_vocab_are_400s(tokenizer):
    with _serve(tokenizer) as s, httpx.Client(base_url=s.url) as h:
        body = b'{"prompt": "a\\ud800b", "max_tokens": 1}'
        e = _err(h.post(C, content=body, headers={"content-type": "application/json"}), 400)
        assert e["param"] == "prompt" and "surrogate" in e["message"]
        body = b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 1}'
        e = _err(h.post(CH, content=body, headers={"content-type": "application/json"}), 400)
        assert e["param"] == "messages[0].content"
        vocab = len(tokenizer)
        e = _err(h.post(C, json={"prompt": "hi", "max_tokens": 1, "top_k": vocab + 1}), 400)
        assert e["param"] == "top_k" and str(vocab) in e["message"]
        assert h.post(C, json={"prompt": "hi", "max_tokens": 1, "top_k": vocab}
                      ).status_code == 200
        assert len(s.backend.calls) == 1


def test_context_length_and_max_prompt_tokens_are_400s_before_admission(tokenizer):
    with _serve(tokenizer, context_length=50, max_prompt_tokens=30) as s, \
            httpx.Client(base_url=s.url) as h:
        e = _err(h.post(C, json={"prompt": list(range(60)), "max_tokens": 1}), 400)
        assert "context length of 50" in e["message"] and e["param"] == "prompt"
        e = _err(h.post(C, json={"prompt": list(range(40)), "max_tokens": 1}), 400)
        assert "--max-prompt-tokens" in e["message"]
        assert s.backend.calls == []
        assert h.post(C, json={"prompt": list(range(30)), "max_tokens": 1}).status_code == 200


def test_prompt_plus_max_tokens_past_the_context_is_a_400(tokenizer):
    """The prompt plus max_tokens (or max_completion_tokens) may not pass the
    model's context; a default max_tokens is lowered to fit instead."""
    with _serve(tokenizer, context_length=50) as s, httpx.Client(base_url=s.url) as h:
        e = _err(h.post(C, json={"prompt": list(range(40)), "max_tokens": 11}), 400)
        assert e["param"] == "max_tokens"
        assert "51 tokens" in e["message"] and "context length of 50" in e["message"]
        assert "at most 10" in e["message"]
        e = _err(h.post(CH, json={"messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": 60}), 400)
        assert e["param"] == "max_completion_tokens" and "context length of 50" in e["message"]
        e = _err(h.post(C, json={"prompt": list(range(50))}), 400)
        assert e["param"] == "prompt" and "no room" in e["message"]
        assert s.backend.calls == []
        ok = h.post(C, json={"prompt": list(range(40)), "max_tokens": 10})
        assert ok.status_code == 200, ok.text
        # no max_tokens: the completions default (16) is lowered to the 10 that fit
        ok = h.post(C, json={"prompt": list(range(40))})
        assert ok.status_code == 200, ok.text
        assert [c["params"].max_tokens for c in s.backend.calls] == [10, 10]


def test_api_key(tokenizer):
    with _serve(tokenizer, api_key="sekrit") as s, httpx.Client(base_url=s.url) as h:
        e = _err(h.post(C, json={"prompt": "hi", "max_tokens": 1}), 401)
        assert e["type"] == "authentication_error"
        _err(h.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        _err(h.get("/metrics"), 401)
        assert h.get("/health").status_code == 200
        ok = h.post(C, json={"prompt": "hi", "max_tokens": 1},
                    headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and len(s.backend.calls) == 1


def test_cors_allowed_origin(tokenizer):
    with _serve(tokenizer, allowed_origins=["https://app.example"], api_key="k") as s, \
            httpx.Client(base_url=s.url) as h:
        pre = h.options(C, headers={"Origin": "https://app.example",
                                    "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        r = h.get("/v1/models", headers={"Origin": "https://app.example",
                                         "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = h.get("/v1/models", headers={"Origin": "https://evil.example",
                                         "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
    with _serve(tokenizer) as s, httpx.Client(base_url=s.url) as h:   # off by default
        r = h.get("/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers


def test_a_large_prompt_does_not_stall_health(tokenizer):
    """A 2 MB prompt is decoded and tokenized in a thread: /health answers
    meanwhile, and the prompt is refused as longer than the context."""
    with _serve(tokenizer, context_length=4096) as s, httpx.Client(base_url=s.url,
                                                                    timeout=60) as h:
        out = {}

        def big():
            t = time.monotonic()
            out["r"] = httpx.post(s.url + C, json={"prompt": "word " * 400_000,
                                                   "max_tokens": 1}, timeout=60)
            out["s"] = time.monotonic() - t
        th = threading.Thread(target=big)
        th.start()
        worst = 0.0
        while th.is_alive():
            t = time.monotonic()
            assert h.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.02)
        th.join()
        e = _err(out["r"], 400)
        assert "context length" in e["message"]
        print(f"large prompt answered in {out['s']:.2f} s; worst /health {worst * 1000:.0f} ms")
        assert worst < max(1.0, out["s"] / 3), (worst, out["s"])


# ------------------------------------------------------------ SSE keep-alive
def _sse_lines(url, body):
    with httpx.stream("POST", url + C, json=body, timeout=30) as r:
        assert r.status_code == 200
        return [ln for ln in r.iter_lines() if ln]


def test_a_stream_waiting_for_its_first_token_gets_keepalive_comments(tokenizer, monkeypatch):
    from shmcache.server import responses
    monkeypatch.setattr(responses, "KEEPALIVE_S", 0.1)
    with _serve(tokenizer) as s:
        s.backend.start_delay = 0.5
        lines = _sse_lines(s.url, {"prompt": "hi", "max_tokens": 5, "stream": True})
        first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data:"))
        assert first_data >= 2 and all(ln == ": keep-alive" for ln in lines[:first_data])
        assert lines[-1] == "data: [DONE]"
        # an error once admission fails: an error event, after the comments
        from workers.protocol import Error
        s.backend.error_first = Error("no worker can take it", 503)
        lines = _sse_lines(s.url, {"prompt": "hi", "max_tokens": 5, "stream": True})
        assert lines[0] == ": keep-alive" and "no worker can take it" in lines[-2]
        # no delay: no comment
        s.backend.start_delay, s.backend.error_first = 0.0, None
        lines = _sse_lines(s.url, {"prompt": "hi", "max_tokens": 5, "stream": True})
        assert lines[0].startswith("data:")


def test_a_client_leaving_during_the_keepalives_cancels_the_request(tokenizer, monkeypatch):
    from shmcache.server import responses
    monkeypatch.setattr(responses, "KEEPALIVE_S", 0.1)
    with _serve(tokenizer) as s:
        s.backend.start_delay = 30
        with httpx.stream("POST", s.url + C, json={"prompt": "hi", "stream": True},
                          timeout=30) as r:
            for ln in r.iter_lines():
                if ln == ": keep-alive":
                    break
        deadline = time.monotonic() + 10
        while s.backend.calls[0]["closed"] is None:
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.05)

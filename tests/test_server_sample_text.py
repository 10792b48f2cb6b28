"""One sample's text (``shmcache.server.sample_text``): stop strings and
streaming detokenization, through the HTTP layer and alone with both of
mlx_lm's streaming detokenizers.

The backend is a fake and the server runs in this process
(``tests/_fake_backend.py``).
"""

from __future__ import annotations

import pytest

from _fake_backend import MODEL
from _fake_backend import client, fake, served, tokenizer  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["client", "fake", "served", "tokenizer"]

pytestmark = pytest.mark.timeout(60)


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

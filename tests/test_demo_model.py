"""shmcache.models.demo_model: offline mlx-lm model directories with random weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import shmcache  # noqa: F401  (first: the fast BLAS before mlx)
from shmcache.models import demo_model as D

mlx_lm = pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["hello world", " leading space and trailing ", "tab\tnew\nline\r\n\x00nul",
         "héllo wörld — naïve café", "日本語のテキスト", "emoji 🎉👍🏽 and ZWJ 👩‍💻",
         "mixed: Ä ß ∑ ∫ € 𝔘 <not special> <|user|> markers"]


def _greedy(model, tok, prompt: str, n: int = 20) -> list[int]:
    ids = mx.array(tok.encode(prompt))
    sampler = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    return [int(t) for (t, _), _ in zip(generate_step(ids, model, sampler=sampler), range(n))]


@pytest.fixture(scope="module", params=D.ARCHS)
def built(request, tmp_path_factory):
    return request.param, D.build_model_dir(tmp_path_factory.mktemp(request.param),
                                            request.param)


def test_directory_is_complete(built):
    arch, path = built
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    import json
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["max_position_embeddings"]) == (256, 4, 8, 4, 32, 768, 8192)
    assert 256 < cfg["vocab_size"] <= 300
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    assert "chat_template" in tcfg and tcfg["eos_token"] == D.EOS


def test_generate_is_deterministic_across_loads(built):
    arch, path = built
    m1, t1 = mlx_lm.load(str(path))
    m2, t2 = mlx_lm.load(str(path))
    a = _greedy(m1, t1, "The quick brown fox")
    b = _greedy(m2, t2, "The quick brown fox")
    assert a == b and len(a) == 20
    assert len(set(a)) >= 5, a                 # not one token repeated forever
    text = mlx_lm.generate(m1, t1, "The quick brown fox", max_tokens=20)
    assert text == t1.decode(a) and len(text) == 20   # greedy output is printable ASCII
    assert text == mlx_lm.generate(m2, t2, "The quick brown fox", max_tokens=20)


def test_weights_follow_the_seed(tmp_path):
    w = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        p = D.build_model_dir(tmp_path / name, "qwen3", seed=seed, num_hidden_layers=1)
        w[name] = mx.load(str(p / "model.safetensors"))
    assert w["a"].keys() == w["b"].keys() == w["c"].keys()
    assert all(mx.array_equal(w["a"][k], w["b"][k]).item() for k in w["a"])
    assert not all(mx.array_equal(w["a"][k], w["c"][k]).item() for k in w["a"])


def test_tokenizer_round_trip(built):
    _, path = built
    _, tok = mlx_lm.load(str(path))
    for s in TEXTS:
        ids = tok.encode(s)
        assert tok.decode(ids) == s, s
        # the streaming detokenizer mlx-lm uses: the same text, and never a
        # half-decoded character on the way
        det = tok.detokenizer
        det.reset()
        parts = []
        for t in ids:
            det.add_token(t)
            parts.append(det.last_segment)
            assert "\ufffd" not in parts[-1], (s, parts)
        det.finalize()
        parts.append(det.last_segment)
        assert "".join(parts) == s, (s, parts)
    plain = "plain ascii text"
    assert len(tok.encode(plain)) == len(plain)          # one token per byte, no bos
    assert len(tok.encode("é")) == 2


def test_chat_template_and_special_tokens(built):
    _, path = built
    _, tok = mlx_lm.load(str(path))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == ("<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi ü<|end|>\n"
                    "<|assistant|>\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    vocab = tok.get_vocab()
    for t in D.SPECIAL_TOKENS:
        assert t in vocab and tok.convert_tokens_to_ids(t) >= 256
    assert ids.count(vocab["<|end|>"]) == 2 and vocab["<|assistant|>"] in ids
    assert {vocab[D.EOS], vocab[D.END_OF_TURN]} <= set(tok.eos_token_ids)
    m, _ = mlx_lm.load(str(path))
    out = _greedy(m, tok, text, n=30)
    assert len(set(out)) >= 5


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        D.build_model_dir(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError):
        D.build_model_dir(tmp_path / "y", dtype="int8")
    with pytest.raises(ValueError):
        D.build_model_dir(tmp_path / "z", "qwen2", head_dim=64)


def test_other_dtype_and_size(tmp_path):
    p = D.build_model_dir(tmp_path / "h", "qwen2", dtype="bfloat16", hidden_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    m, tok = mlx_lm.load(str(p))
    assert m.model.embed_tokens.weight.dtype == mx.bfloat16
    assert len(_greedy(m, tok, "hi", n=8)) == 8


def test_ensure_demo_model_builds_once(tmp_path, capsys):
    p = D.ensure_demo_model(tmp_path)
    assert p == tmp_path / "demo-model-v1"
    assert "building the demo model" in capsys.readouterr().err
    weights = p / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert D.ensure_demo_model(tmp_path) == p
    assert weights.stat().st_mtime_ns == stamp            # reused, not rebuilt
    assert capsys.readouterr().err == ""
    assert [x.name for x in tmp_path.iterdir()] == ["demo-model-v1"]   # no temp dirs left
    m, tok = mlx_lm.load(str(p))
    assert len(set(_greedy(m, tok, "hello"))) >= 5


def test_ensure_demo_model_replaces_an_incomplete_one(tmp_path):
    broken = tmp_path / "demo-model-v1"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    p = D.ensure_demo_model(tmp_path, progress=False)
    assert p == broken and (p / "model.safetensors").is_file()
    assert [x.name for x in tmp_path.iterdir()] == ["demo-model-v1"]


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert D.demo_model_path() == tmp_path / "shmcache" / "demo-model-v1"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert D.demo_model_path() == Path.home() / ".cache" / "shmcache" / "demo-model-v1"


def test_concurrent_builders_agree(tmp_path):
    code = ("import sys, shmcache\nfrom shmcache.models.demo_model import ensure_demo_model\n"
            "print(ensure_demo_model(sys.argv[1], progress=False))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert {o[0].strip() for o in outs} == {str(tmp_path / "demo-model-v1")}
    assert [x.name for x in tmp_path.iterdir()] == ["demo-model-v1"]
    _, tok = mlx_lm.load(str(tmp_path / "demo-model-v1"))
    assert tok.decode(tok.encode("ok ✓")) == "ok ✓"

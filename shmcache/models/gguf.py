"""Convert a llama-family GGUF file (llama.cpp's format) into an mlx-lm model directory.

:func:`convert` reads the file with ``mx.load(path, return_metadata=True)``
(MLX's own GGUF reader) and writes config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with the file's chat template) and
special_tokens_map.json, so that ``mlx_lm.load(dir)`` and ``shmcache serve
--model dir`` work offline.

Supported:
* architectures ``llama`` (also what llama.cpp writes for Mistral and
  SmolLM) and ``qwen2``;
* tensor types F32, F16 and the ones MLX reads as quantized triplets
  (uint32 weight, float16 scales and biases, group size 32): Q4_0, Q4_1
  (4 bits) and Q8_0 (8 bits);
* a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``), built
  with ``tokenizers`` from ``tokenizer.ggml.tokens``/``merges``, its
  control tokens made special tokens.
Anything else (another architecture, tensor type or tokenizer, a tensor
this mapping does not know, missing metadata) raises
:class:`UnsupportedModelError` with one line naming it; nothing is written.

Invariants of the output:
* Q and K weights of a llama GGUF are un-permuted: llama.cpp's converter
  interleaves each head's rows for its RoPE layout; the directory has the
  Hugging Face row order, which mlx-lm's (non-traditional) RoPE expects.
  qwen2 files are not permuted by llama.cpp and are copied as they are.
* By default (``quantized=False``) every weight is float32: quantized ones
  are dequantized with float32 scales. MLX's CPU backend is fast only in
  float32 (issue 27: a 576x1536 matmul on 64 rows took 6.8 ms dense float32,
  67 ms 4-bit with float32 scales, 2,737 ms 4-bit with float16 scales), at
  the cost of memory: 4 bytes per parameter, printed by the conversion.
* ``quantized=True`` keeps the quantized weights as they are (their scales
  and biases made float32, for the reason above); config.json then has a
  ``quantization`` entry (group size 32, the most common bit width) with
  one override per layer whose width differs (SmolLM2's embedding is Q8_0
  while its layers are Q4_1) or that is not quantized (``false``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

__all__ = ["UnsupportedModelError", "convert", "read_gguf", "ARCHITECTURES",
           "GROUP_SIZE"]

ARCHITECTURES = ("llama", "qwen2")
GROUP_SIZE = 32               # MLX's group size for every GGUF quantized type

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
# qwen2 has biases on q, k and v; a llama GGUF has none.
_BIASED = {"llama": (), "qwen2": ("attn_q", "attn_k", "attn_v")}
_HF_NAMES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# The pre-tokenizer split regexes of the byte-level vocabularies llama.cpp
# names in tokenizer.ggml.pre (facts of those vocabularies, written here).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class UnsupportedModelError(ValueError):
    """A GGUF file this converter cannot turn into an mlx-lm model; the
    message is one line naming what is unsupported or missing."""


# ----------------------------------------------------------------- reading
def read_gguf(path) -> tuple:
    """(tensors, metadata) of the GGUF file at path, as ``mx.load`` gives them."""
    import mlx.core as mx
    path = Path(path)
    if not path.is_file():
        raise UnsupportedModelError(f"no such GGUF file: {path}")
    try:
        return mx.load(str(path), format="gguf", return_metadata=True)  # type: ignore[return-value]
    except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError/ValueError for bad files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModelError(f"cannot read {path} as GGUF: {first}") from None


def _meta_value(meta: dict, key: str):
    v = meta.get(key)
    if v is None:
        return None
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _need(meta: dict, key: str):
    v = _meta_value(meta, key)
    if v is None:
        raise UnsupportedModelError(f"GGUF metadata {key!r} is missing")
    return v


# ----------------------------------------------------------------- config
def _model_config(meta: dict, arch: str, vocab_size: int, tied: bool) -> dict:
    p = arch + "."
    heads = int(_need(meta, p + "attention.head_count"))
    kv_heads = int(_meta_value(meta, p + "attention.head_count_kv") or heads)
    hidden = int(_need(meta, p + "embedding_length"))
    head_dim = int(_meta_value(meta, p + "attention.key_length") or hidden // heads)
    cfg = {
        "model_type": arch, "architectures": [_HF_NAMES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": int(_need(meta, p + "block_count")),
        "intermediate_size": int(_need(meta, p + "feed_forward_length")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_need(meta, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta_value(meta, p + "rope.freq_base") or 10000.0),
        "max_position_embeddings": int(_meta_value(meta, p + "context_length") or 4096),
        "vocab_size": vocab_size, "tie_word_embeddings": tied, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif head_dim != hidden // heads:
        raise UnsupportedModelError(f"{arch} with head_dim {head_dim} != hidden {hidden} // "
                                    f"heads {heads} is not supported")
    scaling = _meta_value(meta, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        factor = _meta_value(meta, p + "rope.scaling.factor")
        if scaling != "linear" or not factor:
            raise UnsupportedModelError(f"RoPE scaling {scaling!r} is not supported "
                                        "(only 'linear')")
        cfg["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    if heads % kv_heads:
        raise UnsupportedModelError(f"attention.head_count {heads} is not a multiple of "
                                    f"head_count_kv {kv_heads}")
    return cfg


# ----------------------------------------------------------------- tensors
def _group(tensors: dict, arch: str) -> dict:
    """{hf_name: {"weight"|"bias": array, ...}} with quantized weights as
    (weight, scales, biases) tuples; raises on any tensor it cannot place."""
    out: dict = {}
    for name, arr in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind not in ("weight", "scales", "biases", "bias"):
            raise UnsupportedModelError(f"tensor {name!r} is not supported")
        if base in _TOP_TENSORS:
            hf, gg = _TOP_TENSORS[base], base
        else:
            parts = base.split(".")
            if (len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit()
                    or parts[2] not in _LAYER_TENSORS):
                raise UnsupportedModelError(f"tensor {name!r} is not supported for {arch}")
            gg = parts[2]
            hf = f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[gg]}"
        if kind == "bias" and gg not in _BIASED[arch]:
            raise UnsupportedModelError(f"tensor {name!r} (a bias) is not supported for {arch}")
        out.setdefault(hf, {"gguf": base})[kind] = arr
    return out


def _check_tensor(entry: dict) -> Optional[int]:
    """The entry's bit width if quantized, None if float; raises on other types."""
    import mlx.core as mx
    w, name = entry.get("weight"), entry["gguf"]
    if w is None:
        raise UnsupportedModelError(f"tensor {name}.weight is missing")
    quant = "scales" in entry or "biases" in entry
    if not quant:
        if w.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise UnsupportedModelError(f"tensor {name}.weight has type {w.dtype} "
                                        "(supported: F32, F16, Q4_0, Q4_1, Q8_0)")
        return None
    s, b = entry.get("scales"), entry.get("biases")
    if w.dtype != mx.uint32 or s is None or b is None or w.ndim != 2 or s.shape[-1] == 0:
        raise UnsupportedModelError(f"tensor {name}.weight has an unsupported quantized form")
    bits, rem = divmod(w.shape[-1], s.shape[-1])
    if rem or bits not in (4, 8):
        raise UnsupportedModelError(f"tensor {name}.weight is quantized with {bits} bits "
                                    "(supported: Q4_0, Q4_1, Q8_0)")
    return bits


def _unpermute(x, n_heads: int):
    """Undo llama.cpp's row permutation of a Q or K projection (rows are
    n_heads heads of head_dim rows; llama.cpp stores each head's two RoPE
    halves interleaved)."""
    rows = x.shape[0]
    head_dim = rows // n_heads
    return (x.reshape(n_heads, head_dim // 2, 2, *x.shape[1:]).swapaxes(1, 2)
            .reshape(x.shape))


# ----------------------------------------------------------------- tokenizer
def _byte_level_split(pre: str):
    from tokenizers import Regex, pre_tokenizers
    if pre in ("qwen2", "deepseek-r1-qwen"):
        regex = _QWEN2_SPLIT
    elif pre in ("llama-bpe", "llama3", "smaug-bpe"):
        regex = _LLAMA3_SPLIT
    else:
        regex = None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
    if regex is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level])
    if pre in ("smollm", "starcoder", "refact"):    # every digit a token of its own
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    return byte_level                                # GPT-2's split ("gpt2", "default", ...)


def _check_tokenizer(meta: dict) -> None:
    """Raise unless the metadata holds a byte-level BPE tokenizer with an eos token."""
    model = _meta_value(meta, "tokenizer.ggml.model")
    if model is None:
        raise UnsupportedModelError("GGUF metadata 'tokenizer.ggml.model' is missing")
    if model != "gpt2":
        raise UnsupportedModelError(f"tokenizer {model!r} is not supported (only byte-level "
                                    "BPE, 'gpt2')")
    tokens = _need(meta, "tokenizer.ggml.tokens")
    _need(meta, "tokenizer.ggml.merges")
    eos = _need(meta, "tokenizer.ggml.eos_token_id")
    if not 0 <= int(eos) < len(tokens):
        raise UnsupportedModelError(f"tokenizer.ggml.eos_token_id {eos} is not a token")


def _write_tokenizer(meta: dict, out: Path, max_len: int) -> tuple:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json;
    return (vocab_size, bos_id, eos_id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    _check_tokenizer(meta)
    tokens = _need(meta, "tokenizer.ggml.tokens")
    merges = _need(meta, "tokenizer.ggml.merges")
    types = _meta_value(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = _meta_value(meta, "tokenizer.ggml.pre") or "default"
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    tk.pre_tokenizer = _byte_level_split(pre)
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special
                           if types[vocab[t]] == _TOKEN_CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in special
                   if types[vocab[t]] == _TOKEN_USER_DEFINED])
    tk.save(str(out / "tokenizer.json"))

    def tok_of(key):
        i = _meta_value(meta, key)
        return (int(i), tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else (None, None)
    bos_id, bos = tok_of("tokenizer.ggml.bos_token_id")
    eos_id, eos = tok_of("tokenizer.ggml.eos_token_id")
    _, pad = tok_of("tokenizer.ggml.padding_token_id")
    _, unk = tok_of("tokenizer.ggml.unknown_token_id")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
           "pad_token": pad or eos, "unk_token": unk,
           "add_bos_token": bool(_meta_value(meta, "tokenizer.ggml.add_bos_token")),
           "add_eos_token": bool(_meta_value(meta, "tokenizer.ggml.add_eos_token")),
           "clean_up_tokenization_spaces": False, "model_max_length": max_len,
           "additional_special_tokens": [t for t in special if t not in (bos, eos, pad, unk)]}
    template = _meta_value(meta, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False)
                                               + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token",
                             "additional_special_tokens") if cfg[k] is not None},
        indent=2, ensure_ascii=False) + "\n")
    return len(tokens), bos_id, eos_id


# ----------------------------------------------------------------- convert
def _progress(total: int, show: bool, desc: str):
    """A tqdm bar on a terminal, else None."""
    if show and sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, unit="tensor", leave=False, file=sys.stderr)
        except ImportError:
            pass
    return None


def convert(gguf_path, out_dir, *, quantized: bool = False,
            log: Optional[Callable[[str], None]] = print, progress: bool = True) -> Path:
    """Convert the GGUF file at gguf_path into an mlx-lm model directory at
    out_dir (created; its files of the same names are replaced); return it.

    quantized: keep Q4_0/Q4_1/Q8_0 weights quantized (see the module
    docstring); default: every weight float32. log: called with a few lines
    (what is converted, its parameters and memory; None: silent). progress:
    a tqdm bar over the tensors when stderr is a terminal.
    Raises :class:`UnsupportedModelError` before writing anything if the
    file is not a supported model.
    """
    import mlx.core as mx
    say = log or (lambda s: None)
    t0 = time.perf_counter()
    gguf_path, out = Path(gguf_path), Path(out_dir)
    tensors, meta = read_gguf(gguf_path)
    arch = _meta_value(meta, "general.architecture")
    if arch is None:
        raise UnsupportedModelError("GGUF metadata 'general.architecture' is missing")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
    grouped = _group(tensors, arch)
    bits_of = {hf: _check_tensor(e) for hf, e in grouped.items()}
    if "model.embed_tokens" not in grouped:
        raise UnsupportedModelError("tensor 'token_embd.weight' is missing")
    emb = grouped["model.embed_tokens"]["weight"]
    vocab_rows = emb.shape[0]
    tied = "lm_head" not in grouped
    cfg = _model_config(meta, arch, vocab_rows, tied)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        for g in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_gate", "ffn_up", "ffn_down"):
            if f"model.layers.{i}.{_LAYER_TENSORS[g]}" not in grouped:
                raise UnsupportedModelError(f"tensor 'blk.{i}.{g}.weight' is missing")
    if "model.norm" not in grouped:
        raise UnsupportedModelError("tensor 'output_norm.weight' is missing")
    extra = [e["gguf"] for hf, e in grouped.items() if hf.startswith("model.layers.")
             and int(hf.split(".")[2]) >= cfg["num_hidden_layers"]]
    if extra:
        raise UnsupportedModelError(f"tensor {extra[0]!r} is beyond block_count "
                                    f"{cfg['num_hidden_layers']}")

    _check_tokenizer(meta)
    n_tokens = len(_meta_value(meta, "tokenizer.ggml.tokens"))
    if n_tokens > vocab_rows:
        raise UnsupportedModelError(f"the tokenizer has {n_tokens} tokens but the embedding "
                                    f"only {vocab_rows} rows")
    quant_bits = Counter(b for b in bits_of.values() if b is not None)
    say(f"converting {gguf_path.name}: {arch}, {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, {heads} heads over {kv_heads} KV heads, vocab {vocab_rows}, "
        f"to {'quantized' if quantized else 'float32'} weights in {out}")
    out.mkdir(parents=True, exist_ok=True)
    weights: dict = {}
    overrides: dict = {}
    default_bits = quant_bits.most_common(1)[0][0] if quant_bits else None
    bar = _progress(len(grouped), progress, f"converting {gguf_path.name}")
    f32 = mx.float32
    try:
        for hf, e in grouped.items():
            bits = bits_of[hf]
            gg = e["gguf"].rpartition(".")[2]
            n_perm = (heads if gg == "attn_q" else kv_heads if gg == "attn_k" else 0) \
                if arch == "llama" else 0
            if bits is None:
                w = e["weight"].astype(f32)
                if n_perm:
                    w = _unpermute(w, n_perm)
                weights[f"{hf}.weight"] = w
                if quantized and w.ndim == 2 and default_bits is not None:
                    overrides[hf] = False
            else:
                w, s, b = e["weight"], e["scales"].astype(f32), e["biases"].astype(f32)
                if n_perm:
                    w, s, b = (_unpermute(x, n_perm) for x in (w, s, b))
                if quantized:
                    weights[f"{hf}.weight"], weights[f"{hf}.scales"] = w, s
                    weights[f"{hf}.biases"] = b
                    if bits != default_bits:
                        overrides[hf] = {"group_size": GROUP_SIZE, "bits": bits}
                else:
                    weights[f"{hf}.weight"] = mx.dequantize(w, s, b, group_size=GROUP_SIZE,
                                                            bits=bits)
            if "bias" in e:
                bias = e["bias"].astype(f32)
                weights[f"{hf}.bias"] = _unpermute(bias, n_perm) if n_perm else bias
            mx.eval([v for k, v in weights.items() if k.startswith(hf + ".")])
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    del tensors, grouped
    if quantized and default_bits is not None:
        cfg["quantization"] = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine",
                               **overrides}
    _, bos_id, eos_id = _write_tokenizer(meta, out, cfg["max_position_embeddings"])
    cfg.update(bos_token_id=bos_id, eos_token_id=eos_id)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    nbytes = sum(v.nbytes for v in weights.values())
    params = sum(v.size for k, v in weights.items() if not k.endswith((".scales", ".biases")))
    if quantized:
        params = sum((v.size * 32 // (bits_of.get(k.rsplit(".", 1)[0]) or 32))
                     if v.dtype == mx.uint32 else v.size
                     for k, v in weights.items() if not k.endswith((".scales", ".biases")))
    file_bytes = os.path.getsize(gguf_path)
    say(f"converted in {time.perf_counter() - t0:.1f} s: {params / 1e6:.1f} M parameters, "
        f"weights {nbytes / 2**20:.0f} MiB in memory "
        f"({'quantized, float32 scales' if quantized else 'float32'}; the GGUF file is "
        f"{file_bytes / 2**20:.0f} MiB)")
    return out

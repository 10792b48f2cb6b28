"""A small language model that needs no download: random weights, byte-level tokenizer.

:func:`build_model_dir` writes a complete mlx-lm model directory (config.json,
model.safetensors, tokenizer files with a chat template) for one of mlx-lm's
"llama", "qwen2" or "qwen3" models, with weights drawn from a seed; then
``mlx_lm.load(path)`` and ``mlx_lm.server --model path`` work offline.
:func:`ensure_demo_model` builds the default one once, under
``$XDG_CACHE_HOME/shmcache/demo-model-v1``, and reuses it.

The default size has the compute of a small real model on a 2-core CPU:
hidden 256, 4 layers, 8 query heads over 4 KV heads (GQA), head_dim 32,
MLP 768, float32, tied embeddings. The weights are the model's own init
drawn after ``mx.random.seed(seed)``, with every projection scaled by
PROJ_GAIN and the embedding rows of all but printable ASCII scaled down (see
those constants): greedy decoding then gives varied, readable ASCII instead
of one token repeated forever.

The tokenizer maps every byte to one token (GPT-2's byte-to-character table,
no merges), so any text encodes and ``decode(encode(s)) == s``, plus special
tokens: bos, eos, pad and the chat markers ``<|system|>``, ``<|user|>``,
``<|assistant|>`` and ``<|end|>`` (end of a turn). Its decoder is GPT-2's
ByteLevel decoder inside a one-element Sequence: mlx-lm then streams text
with its NaiveStreamingDetokenizer, which decodes exactly like
``tokenizer.decode`` and holds back an incomplete UTF-8 character. (Given a
bare ByteLevel decoder it picks its BPEStreamingDetokenizer, which drops a
leading space of the output and turns a NUL byte into "Ā".)
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["build_model_dir", "ensure_demo_model", "demo_model_path", "ARCHS", "SPECIAL_TOKENS",
           "DEMO_VERSION"]

ARCHS = ("llama", "qwen2", "qwen3")

# The default demo model's size: about a small real model's compute on a 2-core CPU.
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = 32
INTERMEDIATE_SIZE = 768
MAX_POSITION_EMBEDDINGS = 8192
DTYPE = "float32"
TIE_WORD_EMBEDDINGS = True
RMS_NORM_EPS = 1e-6

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD) + ROLE_MARKERS + (END_OF_TURN,)

#: a turn is "<|role|>\n{content}<|end|>\n"; the generation prompt opens the
#: assistant's turn. Roles other than system/user/assistant are written as text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

#: bump when the default model's files would change (the cache key)
DEMO_VERSION = 1
DEMO_ARCH = "llama"
DEMO_SEED = 0

# Random weights at the models' own init decode greedily into one token
# repeated forever: the residual stream is mostly the input token's embedding,
# and with tied embeddings that token's logit gets a bonus of |e|^2. Every
# projection matrix is scaled by this gain (mlx's init is uniform in
# +-1/sqrt(fan_in); this makes it +-3/sqrt(fan_in)): the layers then dominate
# the residual and greedy output wanders over dozens of distinct tokens.
PROJ_GAIN = 3.0
# The embedding rows (tied: the output rows too) of all tokens but printable
# ASCII, tab and newline are scaled by this: their logits stay near zero, so
# greedy output is readable ASCII (no broken UTF-8) and runs to max_tokens
# instead of ending on an eos or end-of-turn that random weights happen to
# favour. Sampling still reaches them now and then.
OTHER_EMBED_SCALE = 0.05
PRINTABLE = tuple(range(0x20, 0x7F)) + (0x09, 0x0A)

_DTYPES = ("float32", "float16", "bfloat16")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte value 0..255, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _write_tokenizer(path: Path, max_len: int) -> int:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json) into path; return the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.Sequence([decoders.ByteLevel()])      # see the module docstring
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, clean_up_tokenization_spaces=False,
                                   model_max_length=max_len)
    fast.save_pretrained(str(path))
    # The chat template goes into tokenizer_config.json, which every transformers
    # version reads (newer ones would write a separate chat_template.jinja).
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
               bos_token=BOS, eos_token=EOS, pad_token=PAD, add_bos_token=False,
               add_eos_token=False, clean_up_tokenization_spaces=False,
               model_max_length=max_len)
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
         "additional_special_tokens": list(ROLE_MARKERS + (END_OF_TURN,))}, indent=2) + "\n")
    return tk.get_vocab_size(with_added_tokens=True)


def _config(arch: str, vocab_size: int, dtype: str, overrides: dict) -> dict:
    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}[arch]
    cfg: dict[str, Any] = {
        "model_type": arch, "architectures": [arch_name],
        "hidden_size": HIDDEN_SIZE, "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM, "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "rms_norm_eps": RMS_NORM_EPS,
        "tie_word_embeddings": TIE_WORD_EMBEDDINGS, "hidden_act": "silu",
    }
    if arch == "llama":
        cfg.update(rope_theta=10000.0, attention_bias=False, mlp_bias=False)
    elif arch == "qwen2":
        cfg.update(rope_theta=1000000.0)
    else:
        cfg.update(rope_theta=1000000.0, attention_bias=False)
    cfg.update(overrides)
    cfg.update(model_type=arch, vocab_size=vocab_size, torch_dtype=dtype)
    if "head_dim" not in overrides:          # HEAD_DIM is hidden 256 // 8 heads
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "qwen2" and cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise ValueError("qwen2 has head_dim = hidden_size // num_attention_heads: "
                         f"{cfg['hidden_size']} // {cfg['num_attention_heads']} != "
                         f"{cfg['head_dim']}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    return cfg


def build_model_dir(path, arch: str = "llama", *, seed: int = 0, dtype: str = "float32",
                    **overrides) -> Path:
    """Write a complete mlx-lm model directory with random weights at path; return it.

    arch: "llama", "qwen2" or "qwen3" (mlx-lm's model of that name).
    seed: the weights are a function of (arch, seed, dtype, overrides).
    dtype: "float32", "float16" or "bfloat16".
    overrides: config.json entries in place of the defaults (hidden_size=512,
        num_hidden_layers=2, ...); model_type, vocab_size and torch_dtype are set here.

    Writes config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json (with the chat template), special_tokens_map.json
    and shmcache_demo.json (how it was built). path may exist; its files of
    those names are replaced.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from .weights import write_aligned_copy

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    max_len = int(overrides.get("max_position_embeddings", MAX_POSITION_EMBEDDINGS))
    vocab_size = _write_tokenizer(path, max_len)
    cfg = _config(arch, vocab_size, dtype, overrides)
    cfg.update(bos_token_id=256 + SPECIAL_TOKENS.index(BOS),
               eos_token_id=[256 + SPECIAL_TOKENS.index(EOS),
                             256 + SPECIAL_TOKENS.index(END_OF_TURN)],
               pad_token_id=256 + SPECIAL_TOKENS.index(PAD))

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    # MLX's global generator cannot be saved and restored: draw the caller's
    # next seed from it, and reseed it with that afterwards (still deterministic).
    resume = int(mx.random.randint(0, 2**31 - 1, ()).item())  # type: ignore[arg-type]
    mx.random.seed(seed)
    try:
        model = module.Model(module.ModelArgs.from_dict(cfg))   # the model's own init
    finally:
        mx.random.seed(resume)
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.weight = m.weight * PROJ_GAIN
    emb = model.model.embed_tokens
    rows = [i for i in range(vocab_size) if i not in PRINTABLE]
    emb.weight = emb.weight.at[mx.array(rows)].multiply(OTHER_EMBED_SCALE)
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    # every tensor at an aligned offset: processes then map the file itself
    # (shmcache.models.weights) instead of an aligned copy of it
    unaligned = path / ".model.unaligned.safetensors"
    mx.save_safetensors(str(unaligned), weights, metadata={"format": "mlx"})
    try:
        write_aligned_copy(unaligned, path / "model.safetensors")
    finally:
        unaligned.unlink(missing_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "shmcache_demo.json").write_text(json.dumps(
        {"arch": arch, "seed": seed, "dtype": dtype, "overrides": overrides,
         "demo_version": DEMO_VERSION}, indent=2, sort_keys=True) + "\n")
    return path


# ----------------------------------------------------------------- the cached default
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_path(cache_dir=None) -> Path:
    """Where :func:`ensure_demo_model` keeps the default model."""
    if cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = Path(base) / "shmcache"
    return Path(cache_dir) / f"demo-model-v{DEMO_VERSION}"


def complete_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a whole model directory (the files a reader needs)."""
    return all((path / f).is_file() for f in _REQUIRED)


def build_dir_atomically(target: Path, build) -> Path:
    """``build(tmp)`` writes a model directory into a temporary directory beside
    ``target``, which is then renamed into place: a reader never sees half a
    model. Of concurrent builders the first rename wins and the others use its
    result; an incomplete leftover at ``target`` (not one of ours: ours appear
    whole) is set aside first. Returns ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)                               # mkdtemp made it 0700
        try:
            os.rename(tmp, target)
        except OSError:
            if complete_model_dir(target):                          # another builder won the race
                return target
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            try:
                os.rename(target, aside / "old")
            except OSError:
                pass
            shutil.rmtree(aside, ignore_errors=True)
            try:
                os.rename(tmp, target)
            except OSError:
                if not complete_model_dir(target):
                    raise
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_demo_model(cache_dir=None, progress: bool = True) -> Path:
    """The default demo model's directory, built on first use; reused after.

    cache_dir: the directory that holds ``demo-model-v1`` (default
    ``$XDG_CACHE_HOME/shmcache``, ``~/.cache/shmcache`` without it).
    It is built into a temporary directory beside the target and renamed into
    place, so a reader never sees half a model; of concurrent builders the
    first rename wins and the others use its result. progress: print one line
    to stderr when it builds.
    """
    target = demo_model_path(cache_dir)
    if complete_model_dir(target):
        return target
    if progress:
        print(f"shmcache: building the demo model ({DEMO_ARCH}, {NUM_LAYERS} layers, hidden "
              f"{HIDDEN_SIZE}, random weights) in {target} ...", file=sys.stderr, flush=True)
    return build_dir_atomically(
        target, lambda tmp: build_model_dir(tmp, DEMO_ARCH, seed=DEMO_SEED, dtype=DTYPE))

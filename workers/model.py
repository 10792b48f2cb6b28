"""A small decoder-only transformer in MLX, used by the shmcache workers.

The model touches the KV cache only through the :class:`KVCacheSeam` protocol,
so the same code runs against the in-process reference
(:class:`InMemoryKVCache`) and against the shared-memory paged pool.

Offset contract: ``cache.offset`` is the number of tokens of the request that
are already stored *before* the current chunk. The model reads it but never
changes it; after a forward pass over a chunk of T tokens the **caller** calls
``cache.advance(T)`` (:func:`prefill` and :func:`decode_step` do this).

Determinism: weights come only from ``config.seed``; every chunk is a fixed,
deterministic computation of (weights, tokens, offset, stored K/V). Exact
bit-for-bit equality across *different* chunk splits is NOT guaranteed by
floating point in general (different matmul shapes may sum in a different
order); only closeness is. The project therefore makes prefill always use
block-aligned chunks, so the same block boundaries produce the same
computations and the same stored K/V (kept in the compute dtype), no matter
which process computed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_INIT_SCALE = 0.02


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    dim: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 4096
    hidden_dim: int = 688  # SwiGLU hidden size
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0
    dtype: str = "float32"  # "float16" | "bfloat16" | "float32"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.dim % self.num_heads:
            raise ValueError("dim must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def mx_dtype(self) -> mx.Dtype:
        return _DTYPES[self.dtype]


@runtime_checkable
class KVCacheSeam(Protocol):
    """The only way attention touches the KV cache (batch 1, batch dim dropped).

    ``offset``: tokens of this request already stored before the current chunk;
    the chunk occupies absolute positions ``offset .. offset+T-1``. The model
    never mutates it; the caller calls ``advance(T)`` after the forward pass.

    ``update_and_fetch(layer, keys, values)``: ``keys``/``values`` of the current
    chunk, shape (H_kv, T, D), with rotary already applied to ``keys`` at their
    absolute positions, are stored; returns the request's whole K/V for that
    layer, shape (H_kv, offset+T, D), including this chunk.
    """

    @property
    def offset(self) -> int: ...

    def update_and_fetch(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def advance(self, n: int) -> None: ...


class InMemoryKVCache:
    """In-process reference implementation of :class:`KVCacheSeam`.

    Keeps one concatenated (H_kv, S, D) array per layer. It is for tests and
    reference runs only -- it is not the shared-memory paged pool.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._offset = 0
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers

    @property
    def offset(self) -> int:
        return self._offset

    def update_and_fetch(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev_k, prev_v = self.keys[layer], self.values[layer]
        stored = 0 if prev_k is None else prev_k.shape[1]
        if stored != self._offset:
            raise RuntimeError(f"layer {layer}: {stored} tokens stored but offset is {self._offset}")
        if prev_k is None:
            self.keys[layer], self.values[layer] = keys, values
        else:
            self.keys[layer] = mx.concatenate([prev_k, keys], axis=1)  # (H_kv, S, D)
            self.values[layer] = mx.concatenate([prev_v, values], axis=1)
        return self.keys[layer], self.values[layer]

    def advance(self, n: int) -> None:
        if n < 0:
            raise ValueError("advance(n) needs n >= 0")
        lengths = {k.shape[1] for k in self.keys if k is not None}
        if lengths != {self._offset + n}:
            raise RuntimeError(f"advance({n}) from offset {self._offset} but stored lengths are {lengths}")
        mx.eval([a for a in self.keys + self.values if a is not None])
        self._offset += n


def apply_rope(x: mx.array, offset: int, theta: float = 10000.0) -> mx.array:
    """Rotary embedding on x (B, H, T, D); row t gets absolute position offset+t."""
    return mx.fast.rope(x, x.shape[-1], traditional=False, base=theta, scale=1.0, offset=offset)


def causal_mask(offset: int, length: int) -> mx.array:
    """Boolean (T, offset+T) mask: query i (absolute offset+i) sees keys 0..offset+i."""
    q_pos = mx.arange(offset, offset + length)[:, None]  # (T, 1)
    k_pos = mx.arange(offset + length)[None, :]  # (1, S)
    return k_pos <= q_pos  # (T, S)


class _Init:
    """Deterministic parameter source: every tensor gets its own split of the seed key."""

    def __init__(self, seed: int, dtype: mx.Dtype) -> None:
        self._key = mx.random.key(seed)
        self._dtype = dtype

    def normal(self, *shape: int) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        w = mx.random.normal(shape, dtype=mx.float32, key=sub) * _INIT_SCALE
        return w.astype(self._dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: mx.Dtype) -> None:
        super().__init__()
        self.weight = mx.ones((dim,), dtype=dtype)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, init: _Init) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scale = cfg.head_dim**-0.5
        self.wq = init.normal(cfg.num_heads * cfg.head_dim, cfg.dim)  # (out, in)
        self.wk = init.normal(cfg.num_kv_heads * cfg.head_dim, cfg.dim)
        self.wv = init.normal(cfg.num_kv_heads * cfg.head_dim, cfg.dim)
        self.wo = init.normal(cfg.dim, cfg.num_heads * cfg.head_dim)

    def __call__(self, x: mx.array, cache: KVCacheSeam) -> mx.array:
        B, T, _ = x.shape  # (1, T, dim)
        offset = cache.offset
        q = (x @ self.wq.T).reshape(B, T, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, H, T, D)
        k = (x @ self.wk.T).reshape(B, T, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
        v = (x @ self.wv.T).reshape(B, T, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
        q = apply_rope(q, offset, self.rope_theta)
        k = apply_rope(k, offset, self.rope_theta)  # rotary BEFORE storing
        k_all, v_all = cache.update_and_fetch(self.layer, k[0], v[0])  # (Hkv, offset+T, D)
        if k_all.shape[1] != offset + T:
            raise RuntimeError(f"cache returned {k_all.shape[1]} keys, expected {offset + T}")
        k_all = k_all[None].astype(q.dtype)  # (B, Hkv, S, D)
        v_all = v_all[None].astype(q.dtype)
        mask = causal_mask(offset, T) if T > 1 else None  # a single query sees everything
        out = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=self.scale, mask=mask)  # (B, H, T, D)
        out = out.transpose(0, 2, 1, 3).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, H*D)
        return out @ self.wo.T  # (B, T, dim)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig, init: _Init) -> None:
        super().__init__()
        self.w1 = init.normal(cfg.hidden_dim, cfg.dim)
        self.w3 = init.normal(cfg.hidden_dim, cfg.dim)
        self.w2 = init.normal(cfg.dim, cfg.hidden_dim)

    def __call__(self, x: mx.array) -> mx.array:
        return (nn.silu(x @ self.w1.T) * (x @ self.w3.T)) @ self.w2.T  # (B, T, dim)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, init: _Init) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.mx_dtype)
        self.attention = Attention(cfg, layer, init)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.mx_dtype)
        self.feed_forward = MLP(cfg, init)

    def __call__(self, x: mx.array, cache: KVCacheSeam) -> mx.array:
        h = x + self.attention(self.attention_norm(x), cache)  # (B, T, dim)
        return h + self.feed_forward(self.ffn_norm(h))


class Model(nn.Module):
    """Decoder-only transformer; ``model(tokens (1, T) int32, cache) -> logits (1, T, vocab) float32``.

    Reads ``cache.offset`` but never advances it (the caller does).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        init = _Init(config.seed, config.mx_dtype)
        self.tok_embeddings = init.normal(config.vocab_size, config.dim)
        self.layers = [TransformerBlock(config, i, init) for i in range(config.num_layers)]
        self.norm = RMSNorm(config.dim, config.norm_eps, config.mx_dtype)
        self.output = init.normal(config.vocab_size, config.dim)
        mx.eval(self.parameters())

    def __call__(self, tokens: mx.array, cache: KVCacheSeam, last_only: bool = False) -> mx.array:
        """Logits (1, T, vocab); only the last position's (1, 1, vocab) with ``last_only``
        (a prefill chunk needs no others, and the output projection is the
        largest single matmul)."""
        if tokens.ndim != 2 or tokens.shape[0] != 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must have shape (1, T) with T >= 1, got {tokens.shape}")
        h = self.tok_embeddings[tokens.astype(mx.int32)]  # (1, T, dim)
        for layer in self.layers:
            h = layer(h, cache)
        if last_only:
            h = h[:, -1:]  # (1, 1, dim)
        return (self.norm(h) @ self.output.T).astype(mx.float32)  # (1, T, vocab)


def prefill(model: Model, tokens: list[int], cache: KVCacheSeam, chunk_size: int) -> mx.array:
    """Run the prompt in chunks of ``chunk_size`` (last may be shorter), advancing the
    cache after each chunk. Returns the last position's logits, (vocab,) float32."""
    if not tokens:
        raise ValueError("prefill needs at least one token")
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    logits = None
    for start in range(0, len(tokens), chunk_size):
        chunk = tokens[start : start + chunk_size]
        logits = model(mx.array([chunk], dtype=mx.int32), cache, last_only=True)[0, -1]  # (vocab,)
        mx.eval(logits)
        cache.advance(len(chunk))
    return logits


def decode_step(model: Model, token: int, cache: KVCacheSeam) -> mx.array:
    """Run one token at position cache.offset, advance by 1, return logits (vocab,)."""
    logits = model(mx.array([[token]], dtype=mx.int32), cache)[0, -1]  # (vocab,)
    mx.eval(logits)
    cache.advance(1)
    return logits


def sample(logits: mx.array, temperature: float, rng: np.random.Generator) -> int:
    """Greedy argmax if temperature == 0, else sample softmax(logits / temperature).

    Probabilities are computed in float64 numpy and sampled by inverse CDF with a
    single ``rng.random()`` draw, so the result depends only on the logits and rng.
    """
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    x = np.asarray(logits.astype(mx.float32), dtype=np.float64).reshape(-1)
    if temperature == 0:
        return int(np.argmax(x))
    z = x / temperature
    p = np.exp(z - np.max(z))
    cdf = np.cumsum(p)
    idx = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(idx, x.size - 1)

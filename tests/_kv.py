"""What the KV payload tests share (test_kv, test_kv_read): the pool's
sizes, a pool with an arena, and random K/V blocks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

H, D, T = 2, 8, 4            # num_kv_heads, head_dim, block_size
MXDT = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def kv_pool(make_pool, dtype="float16", layers=2, **kw):
    return make_pool(block_size=T, max_blocks=16, num_layers=layers, num_kv_heads=H,
                     head_dim=D, dtype=dtype, **kw)


def rand(seed: int, tokens: int = T, dtype="float16"):
    a = np.random.default_rng(seed).standard_normal((H, tokens, D)).astype(np.float32)
    return mx.array(a).astype(MXDT[dtype])


def as_np(x) -> np.ndarray:
    return np.array(x.astype(mx.float32))

"""The supervisor's built-in workload: a shared system prompt, varied user turns.

Deterministic in its seed. Most requests share one long system prompt (the
prefix the pool should hold once); some ask for ``n > 1`` samples; a few
come from a second tenant, whose salt keeps its blocks apart even though
its tokens are the same.
"""

from __future__ import annotations

import numpy as np

from .protocol import Request

SECOND_TENANT = "tenant-b"


def build(num_requests: int, seed: int = 0, vocab_size: int = 4096,
          system_tokens: int = 1000, max_new_tokens: int = 24) -> list:
    rng = np.random.default_rng([seed, 1234])
    system = rng.integers(0, vocab_size, system_tokens).tolist()
    out = []
    for i in range(num_requests):
        user = rng.integers(0, vocab_size, int(rng.integers(24, 160))).tolist()
        n = 2 if i % 5 == 2 else (3 if i % 11 == 7 else 1)
        temperature = 0.0 if i % 3 == 0 else 0.8
        salt = SECOND_TENANT if i % 8 == 5 else None
        out.append(Request(id=i, prompt=system + user, max_new_tokens=max_new_tokens, n=n,
                           temperature=temperature, seed=seed, salt=salt))
    return out


def blocks_needed(req: Request, block_size: int) -> int:
    """Blocks one request holds at its peak with no sharing at all."""
    total = len(req.prompt) + req.max_new_tokens
    return -(-total // block_size) * req.n

"""The built-in workload of ``python -m tools.demo``: a shared system
prompt, varied user turns.

Deterministic in its seed. Most requests share one long system prompt (the
prefix the pool should hold once); some ask for ``n > 1`` samples; a few
come from a second tenant, whose ``cache_salt`` keeps its blocks apart even
though its tokens are the same.

Prompts are token ids of printable ASCII characters (32..126): with the demo
model's byte-level tokenizer, token id = byte value, so every prompt is also
readable text. Sampled requests (temperature 0.8) use ``top_k`` 20: the demo
model's random weights give every byte some probability, and the top 20 are
printable, so the generated text is valid UTF-8 that encodes back to exactly
the token ids generated (the server returns text, not ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

SECOND_TENANT = "tenant-b"
PRINTABLE = (32, 127)          # token ids [lo, hi): printable ASCII in a byte-level vocabulary
SAMPLED_TOP_K = 20


@dataclass(frozen=True)
class Request:
    id: int
    prompt: list
    max_new_tokens: int
    n: int = 1
    temperature: float = 0.0
    top_k: int = 0              # 0: off
    seed: int = 0
    salt: Optional[str] = None  # the tenant's cache_salt; None: the default tenant


def build(num_requests: int, seed: int = 0, system_tokens: int = 1000,
          max_new_tokens: int = 24, token_range: tuple = PRINTABLE) -> list:
    lo, hi = token_range
    rng = np.random.default_rng([seed, 1234])
    system = rng.integers(lo, hi, system_tokens).tolist()
    out = []
    for i in range(num_requests):
        user = rng.integers(lo, hi, int(rng.integers(24, 160))).tolist()
        n = 2 if i % 5 == 2 else (3 if i % 11 == 7 else 1)
        sampled = i % 3 != 0
        salt = SECOND_TENANT if i % 8 == 5 else None
        out.append(Request(id=i, prompt=system + user, max_new_tokens=max_new_tokens, n=n,
                           temperature=0.8 if sampled else 0.0,
                           top_k=SAMPLED_TOP_K if sampled else 0, seed=seed, salt=salt))
    return out


def blocks_needed(req: Request, block_size: int) -> int:
    """Blocks one request holds at its peak with no sharing at all."""
    total = len(req.prompt) + req.max_new_tokens
    return -(-total // block_size) * req.n

"""A worker's working K/V buffers are bounded (issue 29, item 13).

Each batch row's K/V also lives in the worker's own MLX arrays (mlx-lm's
``BatchKVCache``), so memory grows with rows x context whatever the pool
shares. With ``max_working_bytes`` the engine admits a request only when the
batch's peak with it fits (``Engine.working_need``): one that would pass the
limit waits for running rows to finish; one that never fits fails with a
400 that says why. The engine runs in this process over a real pool and a
real mlx-lm model (``_mlx_lm``'s ``lm``).
"""

from __future__ import annotations

import random

import pytest

from _mlx_lm import BS, lm, pools  # noqa: F401  (fixtures)
from test_engine import Events, gen, reference

from workers.worker.engine import Engine

__all__ = ["lm", "pools"]


@pytest.mark.timeout(120)
def test_admission_respects_the_working_bytes_limit(lm, pools):  # noqa: F811
    if lm.arch != "llama":
        pytest.skip("one architecture is enough for admission")
    pool = pools(block_size=BS, max_blocks=256, **lm.layout)
    ev = Events()
    probe = Engine(pool, lm.model, [], ev)
    rng = random.Random(13)
    vocab = lm.model.args.vocab_size
    a, b = ([rng.randrange(vocab) for _ in range(40)] for _ in range(2))
    # room for one 40 + 24-token row (one 256-token step), not two
    one = probe.working_need(probe_req(probe, a, 24))
    eng = Engine(pool, lm.model, [], ev, max_working_bytes=one + one // 2)
    eng.submit(gen(1, a, 24))
    eng.submit(gen(2, b, 24))
    eng.submit(gen(3, a, 2000))                  # never fits: 2,064 tokens
    peak, both = 0, False
    for _ in range(10_000):
        if not eng.busy:
            break
        eng.step()
        peak = max(peak, eng.working_bytes())
        both = both or {r.req.gen.id for r in eng.rows} == {1, 2}
    assert not eng.busy
    assert not both, "request 2 ran beside request 1 past the limit"
    assert peak <= eng.max_working_bytes, (peak, eng.max_working_bytes)
    assert ev.tokens[1] == reference(lm.model, a, 24)
    assert ev.tokens[2] == reference(lm.model, b, 24)      # it waited, then ran
    (rid, msg, status), = ev.failed
    assert rid == 3 and status == 400 and "--max-working-bytes" in msg and "max_tokens" in msg
    assert 3 not in ev.tokens
    # without a limit, the two run together
    ev2 = Events()
    free = Engine(pool, lm.model, [], ev2)
    free.submit(gen(4, a, 24))
    free.submit(gen(5, b, 24))
    seen = set()
    while free.busy:
        free.step()
        seen |= {frozenset(r.req.gen.id for r in free.rows)}
    assert frozenset({4, 5}) in seen
    eng.close()
    free.close()
    probe.close()


def probe_req(engine, prompt, max_tokens):
    from workers.worker.engine import _Req
    return _Req(gen(0, prompt, max_tokens), 0)

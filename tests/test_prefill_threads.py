"""A prefill's softmax and SiLU split over MLX CPU streams
(``workers.worker.prefill_threads``).

* The split functions give mlx-lm's bits: SwiGLU, and attention with no
  mask, a causal one over a cached prefix, a boolean (left padding) and an
  additive one, with grouped and ungrouped heads, rows not a multiple of
  the parts.
* Installed on real mlx-lm models (llama, qwen2, qwen3 with random weights),
  the engine's greedy tokens equal mlx-lm's ``generate_step`` computed before
  the install, cold and warm, and the split path did run; ``uninstall``
  puts mlx-lm's functions back.
* Where the bits would differ (the check replaced by one that says so, a
  stand-in), or MLX computes on a GPU (a stand-in too), nothing is
  installed.
* The supervisor's default: the CPUs, at most 8, with 2 or more CPUs a
  worker; else 1.
"""

from __future__ import annotations

import logging
import random
import sys

import pytest

from _mlx_lm import BS, lm, pools  # noqa: F401  (fixtures)
import mlx.core as mx  # noqa: E402
import mlx_lm.models.activations as activations  # noqa: E402
import mlx_lm.models.base as base  # noqa: E402

from workers.worker import prefill_threads as pt  # noqa: E402
from workers.worker.engine import Engine  # noqa: E402
from test_engine import Events, gen, reference, run  # noqa: E402

__all__ = ["lm", "pools"]


@pytest.fixture
def restore():
    yield
    pt.uninstall()


def _model_modules(model):
    return [sys.modules[n] for n in {type(m).__module__ for _, m in model.named_modules()}]


def test_the_split_functions_give_mlx_lms_bits():
    split = pt._Split(4)
    assert [(a, b) for _, a, b in split._parts(70)] == [(0, 18), (18, 36), (36, 54), (54, 70)]
    assert len(split._parts(40)) == 2              # parts of at least MIN_PART_ROWS rows
    keys = iter(mx.random.split(mx.random.key(3), 8))
    gate, x = (mx.random.normal((2, 70, 48), key=next(keys)) for _ in range(2))
    assert mx.array_equal(split.swiglu(gate, x), activations.swiglu(gate, x)).item()
    L, S = 70, 90                                  # 20 cached tokens before the 70 new
    k, v = (mx.random.normal((2, 2, S, 16), key=next(keys)) for _ in range(2))
    pad = mx.arange(S)[None, None, None, :] >= mx.array([0, 7])[:, None, None, None]
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    for heads in (8, 2):
        q = mx.random.normal((2, heads, L, 16), key=next(keys))
        for mask in (None, "causal", pad & causal, mx.where(pad & causal, 0.0, -1e9)):
            want = base.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask=mask)
            got = split.sdpa(q, k, v, None, scale=0.25, mask=mask)
            assert got.shape == want.shape and mx.array_equal(got, want).item(), (heads, mask)
    assert split.calls == 1 + 2 * 4
    # a decode step (one row) goes straight to mlx-lm's functions
    split.sdpa(q[:, :, :1], k, v, None, scale=0.25, mask=None)
    split.swiglu(gate[:, :1], x[:, :1])
    assert split.calls == 9


def test_attention_over_a_long_context_is_not_split(monkeypatch):
    """Scores larger than MAX_SPLIT_SCORES_BYTES (here lowered) go to
    mlx-lm's function whole: the split would hold a second copy of them."""
    split = pt._Split(4)
    keys = iter(mx.random.split(mx.random.key(5), 3))
    q = mx.random.normal((1, 4, 64, 16), key=next(keys))
    k, v = (mx.random.normal((1, 2, 64, 16), key=next(keys)) for _ in range(2))
    monkeypatch.setattr(pt, "MAX_SPLIT_SCORES_BYTES", 4 * 64 * 64 * 4)       # these scores
    split.sdpa(q, k, v, None, scale=0.25, mask="causal")
    assert split.calls == 1
    monkeypatch.setattr(pt, "MAX_SPLIT_SCORES_BYTES", 4 * 64 * 64 * 4 - 1)
    got = split.sdpa(q, k, v, None, scale=0.25, mask="causal")
    assert split.calls == 1
    want = base.scaled_dot_product_attention(q, k, v, None, scale=0.25, mask="causal")
    assert mx.array_equal(got, want).item()


@pytest.mark.timeout(300)
def test_greedy_tokens_equal_mlx_lm_with_the_split_installed(lm, pools, restore):  # noqa: F811
    rng = random.Random(11)
    vocab = lm.model.args.vocab_size
    shared = [rng.randrange(vocab) for _ in range(6 * BS + 5)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(k)] for k in (3, 50, 70)]
    want = [reference(lm.model, p, 10) for p in prompts]      # before the install
    assert pt.install(lm.model, 3) == 3
    mods = _model_modules(lm.model)
    split = next(m.swiglu.__self__ for m in mods if hasattr(getattr(m, "swiglu", None), "__self__"))
    pool = pools(block_size=BS, max_blocks=512, **lm.layout)
    ev = Events()
    eng = Engine(pool, lm.model, [], ev, prefill_step=8 * BS)
    eng.submit(gen(1, prompts[0], 10))             # cold
    run(eng)
    for i, p in enumerate(prompts[1:], 2):         # warm, two in one batch
        eng.submit(gen(i, p, 10))
    run(eng)
    eng.close()
    assert ev.failed == []
    assert [ev.tokens[i] for i in (1, 2, 3)] == want
    assert split.calls > 0                         # the split path ran
    pt.uninstall()
    for m in mods:
        if hasattr(m, "swiglu"):
            assert m.swiglu is activations.swiglu
        if hasattr(m, "scaled_dot_product_attention"):
            assert m.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_nothing_is_installed_where_the_bits_differ(lm, monkeypatch, caplog, restore):  # noqa: F811
    # a stand-in for a machine whose MLX composes attention otherwise
    monkeypatch.setattr(pt, "_agrees", lambda split: "attention (causal mask, 6 query heads)")
    with caplog.at_level(logging.WARNING, logger=pt.__name__):
        assert pt.install(lm.model, 4) == 1
    assert "prefill threads off" in caplog.text and "attention (causal mask" in caplog.text
    assert pt.install(lm.model, 1) == 1
    monkeypatch.setattr(pt, "_agrees", lambda split: None)
    monkeypatch.setattr(pt, "_on_cpu", lambda: False)        # a stand-in for a GPU
    assert pt.install(lm.model, 4) == 1
    for m in _model_modules(lm.model):
        assert getattr(m, "swiglu", activations.swiglu) is activations.swiglu
        assert getattr(m, "scaled_dot_product_attention",
                       base.scaled_dot_product_attention) is base.scaled_dot_product_attention


@pytest.mark.parametrize("cpus, workers, want", [(16, 8, 8), (64, 4, 8), (2, 2, 1), (2, 1, 2),
                                                 (3, 2, 1), (4, 2, 4)])
def test_the_default_threads_need_two_cpus_a_worker(monkeypatch, cpus, workers, want):
    from workers.supervisor import worker_procs
    monkeypatch.setattr(worker_procs, "cpus_available", lambda: cpus)
    assert worker_procs.prefill_threads_per_worker(workers) == want

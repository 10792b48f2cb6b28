"""Fixtures and helpers of the tests of ``shmcache.models.mlx_lm`` (``test_mlx_lm``,
``test_mlx_lm_batch``).

Every test runs real mlx-lm models (llama, qwen2, qwen3 with random weights,
built once per test module by ``shmcache.models.demo_model``: the ``lm`` fixture)
and checks two things: the tokens are the ones mlx-lm gives with its own
caches, and the pool holds exactly (bitwise) the K/V the model computed.
Prefill goes in chunks of one block (``prefill_step_size = BS``), so a cached
prefix ends where a chunk would have ended and the K/V are the same bits with
or without the pool. The fixtures (``lm``, ``pools``, ``pool``) are imported
by name into the test modules that use them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import shmcache  # (first: the fast BLAS before mlx)
from shmcache.shm import segment

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from conftest import new_name  # noqa: E402
from shmcache.models import mlx_lm as P  # noqa: E402
from shmcache.models.demo_model import ARCHS, build_model_dir  # noqa: E402


BS = 16

TEXT = "Hello there, this is a test of the pooled cache. "


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=ARCHS)
def lm(request, tmp_path_factory):
    """(arch, path, model, tok, layout) of one architecture, built and loaded once."""
    arch = request.param
    path = build_model_dir(tmp_path_factory.mktemp(f"mlx-lm-{arch}"), arch)
    model, tok = load(str(path))
    return SimpleNamespace(arch=arch, path=path, model=model, tok=tok,
                           layout=P.pool_layout(model))


@pytest.fixture
def pools():
    """Factory: pools(**kw) -> creator manager of a fresh, uniquely named pool.
    Every one is checked (``check() == []``) and destroyed at teardown, even
    when the test failed; managers passed to ``others.append`` are closed first."""
    made, others = [], []

    def factory(**kw):
        name = new_name("mlxlm")
        try:
            m = shmcache.create_pool(name, **kw)
        except BaseException:
            segment.unlink(name)
            raise
        made.append(m)
        return m

    factory.others = others
    yield factory
    problems = {}
    for o in others:
        try:
            o.close()
        except Exception:
            pass
    for m in made:
        try:
            problems[m.name] = m.check()
        except Exception as e:  # noqa: BLE001 - still destroy every pool
            problems[m.name] = [f"check() raised {e!r}"]
        finally:
            try:
                m.destroy()
            except Exception:  # noqa: BLE001
                pass
            segment.unlink(m.name)
    assert all(p == [] for p in problems.values()), problems


@pytest.fixture
def pool(lm, pools):
    """A pool laid out for ``lm``'s model, block size BS."""
    return pools(block_size=BS, max_blocks=256, **lm.layout)


# ----------------------------------------------------------------- helpers
def encode(lm, text: str) -> list:
    return list(lm.tok.encode(text))


def generate(model, prompt, cache, n: int) -> list:
    """n greedy tokens from mlx-lm's generate_step (every one is fed back, so
    the cache ends holding prompt + all n tokens)."""
    return [int(y) for y, _ in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                             prefill_step_size=BS, max_tokens=n)]


def prefill(model, prompt, caches) -> int:
    """generate_step's prefill by hand: prompt[:-1] in chunks of BS, then the
    last token; returns the first greedy token."""
    x, i = mx.array(prompt), 0
    while len(prompt) - i > 1:
        n = min(BS, len(prompt) - 1 - i)
        model(x[i:i + n][None], cache=caches)
        mx.eval([c.state for c in caches])
        i += n
    logits = model(x[i:][None], cache=caches)[:, -1, :]
    return int(mx.argmax(logits, axis=-1).item())


def step1(model, y: int, caches) -> int:
    """One greedy decode step of one sequence."""
    return int(mx.argmax(model(mx.array([[y]]), cache=caches)[:, -1, :], axis=-1).item())


def alone(model, prompt, n: int, first=None) -> list:
    """n greedy tokens of the prompt decoded alone with mlx-lm's own KVCache
    (``first`` forces the first token)."""
    caches = [KVCache() for _ in model.layers]
    y = prefill(model, prompt, caches)
    if first is not None:
        y = first
    out = [y]
    while len(out) < n:
        y = step1(model, y, caches)
        out.append(y)
    return out


def start_seq(mgr, model, prompt, rid):
    """A pooled sequence for ``prompt``: its longest cached prefix acquired and
    loaded. Returns (seq, caches, cached tokens)."""
    table = mgr.create_block_table(rid)
    blocks, cached = mgr.acquire_computed_blocks(prompt[:-1])
    for b in blocks:
        mgr.add_block_to_table(table, b, BS)
    seq = P.PoolSequence(mgr, table)
    caches = P.make_pool_cache(model, seq)
    assert P.load_prefix(caches) == cached
    return seq, caches, cached


def eq(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def assert_pool_holds(mgr, seq, kv) -> None:
    """The pool's K/V of ``seq`` (every stored token, full blocks and the
    partial tail separately) are bitwise ``kv``: per layer (keys, values), each
    (H, T, D) with T == seq.stored. Everything staged must be committed."""
    assert seq._staged == [] and seq.reserved == 0
    n = seq.stored
    assert seq.table.num_tokens == n
    assert seq.ids == seq.table.block_ids            # the sequence follows its table
    full, tail = divmod(n, BS)
    assert len(seq.ids) == full + (1 if tail else 0)
    for layer, (k, v) in enumerate(kv):
        assert k.shape[1] == n and v.shape[1] == n
        if full:
            pk, pv = mgr.read_kv(seq.ids[:full], layer)
            assert eq(pk, k[:, :full * BS]), f"layer {layer}: keys of the full blocks differ"
            assert eq(pv, v[:, :full * BS]), f"layer {layer}: values of the full blocks differ"
        if tail:
            pk, pv = mgr.read_kv(seq.ids[full:], layer)
            assert eq(pk[:, :tail], k[:, full * BS:]), f"layer {layer}: keys of the tail differ"
            assert eq(pv[:, :tail], v[:, full * BS:]), f"layer {layer}: values of the tail differ"


def single_kv(caches) -> list:
    """(keys, values) (H, T, D) per layer of one sequence's KVCaches."""
    return [(c.keys[0, :, :c.offset], c.values[0, :, :c.offset]) for c in caches]

"""shmcache.mlx_lm: mlx-lm's KVCache / BatchKVCache written through to a pool.

Every test runs real mlx-lm models (llama, qwen2, qwen3 with random weights,
built once per module by ``shmcache.demo_model``) and checks two things:
the tokens are the ones mlx-lm gives with its own caches, and the pool holds
exactly (bitwise) the K/V the model computed. Prefill goes in chunks of one
block (``prefill_step_size = BS``), so a cached prefix ends where a chunk
would have ended and the K/V are the same bits with or without the pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import shmcache  # noqa: F401  (first: the fast BLAS before mlx)
from shmcache import segment

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import (BatchKVCache, KVCache, RotatingKVCache,  # noqa: E402
                                 make_prompt_cache)

from conftest import new_name  # noqa: E402
from shmcache import mlx_lm as P  # noqa: E402
from shmcache.demo_model import ARCHS, build_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
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


def row_kv(bcaches, i: int) -> list:
    """(keys, values) (H, T, D) per layer of row i of BatchKVCaches (padding cut)."""
    out = []
    for c in bcaches:
        lp = c.left_padding.tolist()[i]
        out.append((c.keys[i, :, lp:c._idx], c.values[i, :, lp:c._idx]))
    return out


def assert_rows_stored(mgr, bcaches) -> None:
    """Every pooled row of a batch: its seq is the same object in every layer,
    its offset is the seq's stored count, and the pool holds its K/V."""
    seqs = bcaches[0].seqs
    for c in bcaches:
        assert len(c.seqs) == len(seqs) and all(a is b for a, b in zip(c.seqs, seqs))
    offsets = bcaches[0].offset.tolist()
    for i, s in enumerate(seqs):
        assert offsets[i] == s.stored
        assert_pool_holds(mgr, s, row_kv(bcaches, i))


def batch_step(model, y, bcaches):
    """One greedy step of the whole batch; then each row's seq commits."""
    y = mx.argmax(model(y[:, None], cache=bcaches)[:, -1, :], axis=-1)
    mx.eval(y)
    for s in bcaches[0].seqs:
        s.commit()
    return y


def merge(per_row_caches):
    """PoolBatchKVCache.merge per layer of several sequences' caches."""
    return [P.PoolBatchKVCache.merge(list(layer)) for layer in zip(*per_row_caches)]


def batch_prompts(lm) -> list:
    """Three prompts of different lengths (none a multiple of BS)."""
    ps = [encode(lm, "Once upon a time, "),
          encode(lm, "The quick brown fox jumps over the lazy dog. " * 1 + "Again"),
          encode(lm, TEXT * 2 + "and more")]
    assert len({len(p) for p in ps}) == 3 and all(len(p) % BS for p in ps)
    return ps


def pooled_rows(mgr, lm, prompts):
    """Each prompt prefilled alone into its own pooled caches. Returns
    (seqs, per-row caches, first tokens)."""
    seqs, caches, firsts = [], [], []
    for i, p in enumerate(prompts):
        s, c, cached = start_seq(mgr, lm.model, p, f"row{i}")
        assert cached == 0
        firsts.append(prefill(lm.model, p, c))
        seqs.append(s)
        caches.append(c)
    return seqs, caches, firsts


# ----------------------------------------------------------------- 1. cold
@pytest.mark.timeout(180)
def test_cold_matches_generate_step_and_pool_holds_kv(lm, pool):
    """Greedy tokens through the pool are mlx-lm's own (generate_step with its
    KVCache), and the pool holds exactly the reference cache's K/V."""
    prompt = encode(lm, TEXT * 3)
    assert len(prompt) % BS                       # a partial last block too
    n = 30
    ref_cache = make_prompt_cache(lm.model)
    ref = generate(lm.model, prompt, ref_cache, n)

    seq, caches, cached = start_seq(pool, lm.model, prompt, "a")
    assert cached == 0
    out = generate(lm.model, prompt[cached:], caches, n)
    seq.commit()
    assert out == ref
    assert seq.stored == len(prompt) + n == ref_cache[0].offset
    assert_pool_holds(pool, seq, single_kv(ref_cache))
    assert seq.publish(prompt + out) == (len(prompt) + n) // BS
    seq.release()
    assert pool.check() == []


# ----------------------------------------------------------------- 2. warm, other process
CHILD = r"""
import json, sys
import shmcache
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from shmcache import mlx_lm as P

name, path, bs, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompt = json.loads(sys.argv[5])
mgr = shmcache.attach(name)
model, _ = load(path)
P.check_pool_matches(mgr, P.pool_layout(model))
table = mgr.create_block_table("child")
blocks, cached = mgr.acquire_computed_blocks(prompt[:-1])
assert cached == 0 and not blocks
seq = P.PoolSequence(mgr, table)
caches = P.make_pool_cache(model, seq)
out = [int(y) for y, _ in generate_step(mx.array(prompt), model, prompt_cache=caches,
                                        prefill_step_size=bs, max_tokens=n)]
seq.commit()
published = seq.publish(prompt + out)
seq.release()
problems = mgr.check()
mgr.close()
print(json.dumps({"out": out, "published": published, "check": problems}))
"""


@pytest.mark.timeout(240)
def test_warm_from_prefix_published_by_another_process(lm, pool):
    """A subprocess attaches by name, decodes cold and publishes; this process
    then finds that prefix, loads it from the pool and decodes the same tokens
    as mlx-lm without any cache reuse: for the same prompt, and for a prompt
    that shares only the child's prompt blocks."""
    prompt = encode(lm, TEXT * 3)
    other = prompt + encode(lm, " but then something else entirely")
    n = 20
    assert len(prompt) > 2 * BS
    ref = generate(lm.model, prompt, make_prompt_cache(lm.model), n)
    ref_other = generate(lm.model, other, make_prompt_cache(lm.model), n)

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", CHILD, pool.name, str(lm.path), str(BS), str(n),
                        json.dumps(prompt)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert child["check"] == []
    assert child["out"] == ref                      # the child decoded like mlx-lm too
    assert child["published"] == (len(prompt) + n) // BS

    # the same prompt: every full block of prompt[:-1] comes from the child
    seq, caches, cached = start_seq(pool, lm.model, prompt, "warm")
    assert cached == (len(prompt) - 1) // BS * BS > 0
    assert seq.stored == cached and caches[0].offset == cached
    out = generate(lm.model, prompt[cached:], caches, n)
    seq.commit()
    assert out == ref
    # the K/V are those of a reference cache that computed everything itself
    ref_cache = make_prompt_cache(lm.model)
    generate(lm.model, prompt, ref_cache, n)
    assert_pool_holds(pool, seq, single_kv(ref_cache))
    seq.release()

    # another continuation of the same prompt: only the prompt's full blocks match
    seq, caches, cached = start_seq(pool, lm.model, other, "warm-other")
    assert cached == len(prompt) // BS * BS > 0
    out = generate(lm.model, other[cached:], caches, n)
    seq.commit()
    assert out == ref_other
    seq.release()
    assert pool.check() == []


# ----------------------------------------------------------------- 3. batched
# NOTE: with this mlx build (CPU) a batch decodes with the same rounding as a
# single sequence: the rows' tokens are checked against each sequence decoded
# alone with mlx-lm's KVCache. The merge test also checks them against
# mlx-lm's own BatchKVCache.merge of plain KVCaches decoded the same way.
@pytest.mark.timeout(180)
def test_batch_merge_decodes_like_each_sequence_alone(lm, pool):
    """Three pooled sequences of different prompt lengths, prefilled
    separately, merged per layer (PoolBatchKVCache.merge) and decoded
    together: each row's tokens equal the sequence decoded alone (batch 1;
    see the NOTE above) and mlx-lm's plain BatchKVCache batch; the pool holds
    each row's working-buffer K/V."""
    prompts = batch_prompts(lm)
    n = 10
    refs = [alone(lm.model, p, n) for p in prompts]

    # mlx-lm's own batch over plain KVCaches
    plain = [[KVCache() for _ in lm.model.layers] for _ in prompts]
    ys = [prefill(lm.model, p, c) for p, c in zip(prompts, plain)]
    pb = [BatchKVCache.merge(list(layer)) for layer in zip(*plain)]
    y, plain_out = mx.array(ys), [[t] for t in ys]
    for _ in range(n - 1):
        y = mx.argmax(lm.model(y[:, None], cache=pb)[:, -1, :], axis=-1)
        for row, t in zip(plain_out, y.tolist()):
            row.append(t)

    seqs, rows, firsts = pooled_rows(pool, lm, prompts)
    bc = merge(rows)
    assert all(isinstance(c, P.PoolBatchKVCache) for c in bc)
    assert [c.layer for c in bc] == list(range(len(lm.model.layers)))
    assert all(all(a is b for a, b in zip(c.seqs, seqs)) for c in bc)
    y, outs = mx.array(firsts), [[t] for t in firsts]
    for _ in range(n - 1):
        y = batch_step(lm.model, y, bc)
        for row, t in zip(outs, y.tolist()):
            row.append(t)
    assert outs == plain_out
    assert outs == refs
    for s, p in zip(seqs, prompts):
        assert s.stored == len(p) + n - 1           # the last token is not fed yet
    assert_rows_stored(pool, bc)
    for s, p, o in zip(seqs, prompts, outs):
        s.publish(p + o)
        s.release()
    assert pool.check() == []


@pytest.mark.timeout(180)
def test_batch_filter_drops_a_row(lm, pool):
    """filter: the longest row (no left padding) is dropped, so the others'
    padding shifts; they keep decoding like alone and their seqs follow."""
    prompts = batch_prompts(lm)
    n = 10
    refs = [alone(lm.model, p, n) for p in prompts]
    seqs, rows, firsts = pooled_rows(pool, lm, prompts)
    drop = max(range(3), key=lambda i: len(prompts[i]))
    keep = [i for i in range(3) if i != drop]
    bc = merge(rows)
    y, outs = mx.array(firsts), [[t] for t in firsts]
    for _ in range(3):
        y = batch_step(lm.model, y, bc)
        for row, t in zip(outs, y.tolist()):
            row.append(t)
    idx_before = bc[0]._idx
    for c in bc:
        c.filter(mx.array(keep))
    assert bc[0]._idx < idx_before                 # the common left padding was cut
    assert all(len(c.seqs) == 2 and all(c.seqs[j] is seqs[i] for j, i in enumerate(keep))
               for c in bc)
    seqs[drop].release()
    outs = [outs[i] for i in keep]
    y = y[mx.array(keep)]
    assert_rows_stored(pool, bc)
    while len(outs[0]) < n:
        y = batch_step(lm.model, y, bc)
        for row, t in zip(outs, y.tolist()):
            row.append(t)
    assert outs == [refs[i] for i in keep]
    assert_rows_stored(pool, bc)
    for s in bc[0].seqs:
        s.release()
    assert pool.check() == []


@pytest.mark.timeout(180)
def test_batch_extend_joins_a_running_batch(lm, pool):
    """extend: a batch of two that has decoded 3 steps takes in a third row
    that decoded 1 step in its own batch (different _idx, so mlx-lm pads);
    all keep decoding like alone and the seqs follow the rows."""
    prompts = batch_prompts(lm)
    n = 10
    refs = [alone(lm.model, p, n) for p in prompts]
    seqs, rows, firsts = pooled_rows(pool, lm, prompts)
    a, b = merge(rows[:2]), merge(rows[2:])
    ya, outs_a = mx.array(firsts[:2]), [[t] for t in firsts[:2]]
    for _ in range(3):
        ya = batch_step(lm.model, ya, a)
        for row, t in zip(outs_a, ya.tolist()):
            row.append(t)
    yb = batch_step(lm.model, mx.array(firsts[2:]), b)
    outs_b = [[firsts[2], yb.item()]]
    assert a[0]._idx != b[0]._idx
    for ca, cb in zip(a, b):
        ca.extend(cb)
    assert all(len(c.seqs) == 3 and all(x is s for x, s in zip(c.seqs, seqs)) for c in a)
    assert_rows_stored(pool, a)
    y, outs = mx.concatenate([ya, yb]), outs_a + outs_b
    for _ in range(5):
        y = batch_step(lm.model, y, a)
        for row, t in zip(outs, y.tolist()):
            row.append(t)
    for o, r in zip(outs, refs):
        assert o == r[:len(o)]
    assert_rows_stored(pool, a)
    for s in seqs:
        s.release()
    assert pool.check() == []


@pytest.mark.timeout(180)
def test_batch_extract_gives_a_pooled_single_cache(lm, pool):
    """extract: row i of a batch comes out as a PoolKVCache per layer, with
    that row's seq and offset; it decodes on alone like the reference and
    the pool keeps in step with it."""
    prompts = batch_prompts(lm)
    n = 10
    refs = [alone(lm.model, p, n) for p in prompts]
    seqs, rows, firsts = pooled_rows(pool, lm, prompts)
    bc = merge(rows)
    y, outs = mx.array(firsts), [[t] for t in firsts]
    for _ in range(3):
        y = batch_step(lm.model, y, bc)
        for row, t in zip(outs, y.tolist()):
            row.append(t)
    i = 0                                          # the shortest: most left padding
    assert bc[0].left_padding.tolist()[i] > 0
    single = [c.extract(i) for c in bc]
    assert all(type(c) is P.PoolKVCache for c in single)
    assert [c.layer for c in single] == list(range(len(lm.model.layers)))
    assert all(c.seq is seqs[i] for c in single)
    assert all(c.offset == seqs[i].stored == len(prompts[i]) + 3 for c in single)
    assert_pool_holds(pool, seqs[i], single_kv(single))
    out, t = outs[i], outs[i][-1]
    while len(out) < n:
        t = step1(lm.model, t, single)
        out.append(t)
    seqs[i].commit()
    assert out == refs[i]
    assert_pool_holds(pool, seqs[i], single_kv(single))
    for s in seqs:
        s.release()
    assert pool.check() == []


def _right_padded_prefill(model, prompts, bc):
    """mlx-lm's BatchGenerator prompt step by hand: prompt[:-1] of every row
    right-padded to one length (``prepare(lengths, right_padding)``), in
    chunks of BS, then ``finalize``; then the last tokens: first greedy tokens."""
    body = [p[:-1] for p in prompts]
    m = max(len(b) for b in body)
    for c in bc:
        c.prepare(lengths=[len(b) for b in body], right_padding=[m - len(b) for b in body])
    x = mx.array([b + [0] * (m - len(b)) for b in body])
    while x.shape[1]:
        model(x[:, :BS], cache=bc)
        mx.eval([c.state for c in bc])
        x = x[:, BS:]
    for c in bc:
        c.finalize()
    y = mx.argmax(model(mx.array([[p[-1]] for p in prompts]), cache=bc)[:, -1, :], axis=-1)
    mx.eval(y)
    return y


@pytest.mark.timeout(180)
def test_batch_prefill_right_padded_in_chunks(lm, pool):
    """A batch prefilled the way mlx-lm's BatchGenerator does it (right
    padding, several chunks, finalize) stores each row's own tokens: a short
    row's real tokens all lie in the first chunk (regression: they were
    counted as T - right_padding in every chunk, so none were stored)."""
    prompts = batch_prompts(lm)
    assert max(map(len, prompts)) - 1 > 2 * BS          # three chunks at least
    n = 6
    refs = [alone(lm.model, p, n) for p in prompts]
    layers = len(lm.model.layers)

    plain = [BatchKVCache([0] * 3) for _ in range(layers)]
    y = _right_padded_prefill(lm.model, prompts, plain)
    plain_out = [[t] for t in y.tolist()]
    for _ in range(n - 1):
        y = mx.argmax(lm.model(y[:, None], cache=plain)[:, -1, :], axis=-1)
        for row, t in zip(plain_out, y.tolist()):
            row.append(t)

    seqs = [P.PoolSequence(pool, pool.create_block_table(f"rp{i}")) for i in range(3)]
    bc = [P.PoolBatchKVCache([0] * 3, seqs, layer) for layer in range(layers)]
    y = _right_padded_prefill(lm.model, prompts, bc)
    for s in seqs:
        s.commit()
    assert [s.stored for s in seqs] == [len(p) for p in prompts]
    assert_rows_stored(pool, bc)
    outs = [[t] for t in y.tolist()]
    for _ in range(n - 1):
        y = batch_step(lm.model, y, bc)
        for row, t in zip(outs, y.tolist()):
            row.append(t)
    assert outs == plain_out
    assert outs == refs
    assert_rows_stored(pool, bc)
    for s in seqs:
        s.release()
    assert pool.check() == []


# ----------------------------------------------------------------- 4. n-way fork
@pytest.mark.timeout(180)
def test_fork_three_ways_keeps_branches_apart(lm, pool):
    """After prefill the table is forked twice; each fork gets its own
    PoolSequence with working buffers sliced from the first. The three
    branches decode different tokens (forced first tokens): the shared
    partial block is copied on write (twice: the last writer keeps the
    original) and each table's K/V equal its own working buffer."""
    prompt = encode(lm, TEXT * 2 + "fork")
    L = len(prompt)
    assert L % BS                                    # the last block is partial: shared
    n = 8
    seq_a, caches_a, _ = start_seq(pool, lm.model, prompt, "a")
    y0 = prefill(lm.model, prompt, caches_a)
    seq_a.commit()
    seq_a.publish(prompt)
    firsts = [y0] + [t for t in (ord("x"), ord("Q"), ord("7")) if t != y0][:2]
    refs = [alone(lm.model, prompt, n, first=f) for f in firsts]
    assert len(set(firsts)) == 3

    seqs, caches = [seq_a], [caches_a]
    for rid in ("b", "c"):
        t = pool.fork_block_table(seq_a.table, rid)
        s = P.PoolSequence(pool, t)
        assert s.stored == L and s.ids == seq_a.ids
        cs = P.make_pool_cache(lm.model, s)
        for c, src in zip(cs, caches_a):
            c.keys = src.keys[..., :src.offset, :]
            c.values = src.values[..., :src.offset, :]
            c.offset = src.offset
        seqs.append(s)
        caches.append(cs)
    shared_tail = seq_a.ids[-1]
    cow0 = pool.get_stats().cow_copies

    outs = [[f] for f in firsts]
    ys = list(firsts)
    for _ in range(n - 1):                           # the branches take turns
        for j in range(3):
            ys[j] = step1(lm.model, ys[j], caches[j])
            seqs[j].commit()
            outs[j].append(ys[j])
    assert outs == refs
    assert len({tuple(o) for o in outs}) == 3
    assert pool.get_stats().cow_copies - cow0 == 2
    full = L // BS
    for s in seqs[1:]:
        assert s.ids[:full] == seq_a.ids[:full]        # full prompt blocks stay shared
    tails = [s.ids[full] for s in seqs]
    assert len(set(tails)) == 3 and shared_tail in tails
    for s, cs in zip(seqs, caches):
        assert s.stored == L + n - 1
        assert_pool_holds(pool, s, single_kv(cs))
    for s, p in zip(seqs, outs):
        s.publish(prompt + p)
        s.release()
    assert pool.check() == []


# ----------------------------------------------------------------- 5. refusals
class _SlidingWindowModel:
    """A unit-level stand-in for a model with a sliding-window layer (as
    Gemma or Mistral have): check_poolable only looks at ``make_cache``."""

    layers = [object(), object()]

    def make_cache(self):
        return [KVCache(), RotatingKVCache(max_size=8)]


@pytest.mark.timeout(60)
def test_check_poolable_refuses_rotating_cache():
    with pytest.raises(P.NotPoolableError, match="RotatingKVCache"):
        P.check_poolable(_SlidingWindowModel())
    with pytest.raises(P.NotPoolableError, match="RotatingKVCache"):
        P.pool_layout(_SlidingWindowModel())
    assert issubclass(P.NotPoolableError, ValueError)


@pytest.mark.timeout(60)
def test_check_pool_matches_names_the_field(lm, pools):
    P.check_poolable(lm.model)                        # plain KVCache everywhere
    assert lm.layout["dtype"] == "float32"
    ok = pools(block_size=BS, max_blocks=8, **lm.layout)
    P.check_pool_matches(ok, lm.layout)
    half = pools(block_size=BS, max_blocks=8, **dict(lm.layout, dtype="float16"))
    with pytest.raises(ValueError, match="dtype") as e:
        P.check_pool_matches(half, lm.layout)
    assert "num_kv_heads" not in str(e.value)
    heads = pools(block_size=BS, max_blocks=8,
                  **dict(lm.layout, num_kv_heads=lm.layout["num_kv_heads"] * 2))
    with pytest.raises(ValueError, match="num_kv_heads") as e:
        P.check_pool_matches(heads, lm.layout)
    assert "dtype" not in str(e.value)
    for m in (ok, half, heads):
        assert m.check() == []


# ----------------------------------------------------------------- 6. publish
@pytest.mark.timeout(180)
def test_publish_while_decoding_finds_every_full_block(lm, pool, pools):
    """Publishing after every token while decoding past several block
    boundaries: another manager then finds every full block of prompt +
    generated tokens, with the K/V the sequence computed."""
    prompt = encode(lm, "Publish me: ")
    n = 60
    seq, caches, cached = start_seq(pool, lm.model, prompt, "pub")
    assert cached == 0
    out, published = [], []
    for y, _ in generate_step(mx.array(prompt), lm.model, prompt_cache=caches,
                              prefill_step_size=BS, max_tokens=n):
        out.append(int(y))
        published.append(seq.publish(prompt + out))   # the blocks stored so far
    seq.commit()
    total = len(prompt) + n
    assert seq.publish(prompt + out) == total // BS >= 4
    # at the k-th token the K/V of prompt + k-1 tokens are stored (the k-th
    # token's are staged by the step that computes token k+1): every full
    # block among them is published as soon as it fills up
    assert published == [(len(prompt) + k) // BS for k in range(n)]
    assert out == generate(lm.model, prompt, make_prompt_cache(lm.model), n)

    other = shmcache.attach(pool.name)
    pools.others.append(other)
    blocks, got = other.acquire_computed_blocks(prompt + out)
    assert got == total // BS * BS
    assert [b.block_id for b in blocks] == seq.ids[:total // BS]
    for layer, c in enumerate(caches):
        k, v = other.read_kv([b.block_id for b in blocks], layer)
        assert eq(k, c.keys[0, :, :got]) and eq(v, c.values[0, :, :got])
    other.free_block_batch(blocks)
    assert other.check() == []
    other.close()
    seq.release()
    assert pool.check() == []


@pytest.mark.timeout(120)
def test_trim_shortens_the_table_and_decoding_goes_on_correctly(lm, pool):
    """mlx-lm's trim over a pooled cache gives back the table's whole blocks
    past the new end; decoding again from there gives the reference tokens
    and the pool holds exactly the working buffer's K/V."""
    mgr, bs = pool, BS
    prompt = encode(lm, "Trimming a pooled cache: " * 4)
    table = mgr.create_block_table("trim")
    seq = P.PoolSequence(mgr, table)
    caches = P.make_pool_cache(lm.model, seq)
    first = generate(lm.model, prompt, caches, 3 * bs)
    seq.commit()
    stored = seq.stored
    assert all(c.is_trimmable() for c in caches)
    cut = 2 * bs + 3
    for c in caches:
        assert c.trim(cut) == cut
    assert seq.stored == stored - cut == caches[0].offset
    assert mgr.get_block_table("trim").num_tokens == seq.stored
    assert len(mgr.get_block_table("trim").block_ids) == -(-seq.stored // bs)
    keep, tokens = seq.stored, prompt + first
    m = cut - 2
    again = generate(lm.model, tokens[keep:keep + 1], caches, m)
    seq.commit()
    assert again == tokens[keep + 1:keep + 1 + m]
    ids = list(mgr.get_block_table("trim").block_ids)
    for layer in range(len(lm.model.layers)):
        k, v = mgr.read_kv(ids, layer)
        n = seq.stored
        assert mx.array_equal(k[:, :n], caches[layer].keys[0, :, :n])
        assert mx.array_equal(v[:, :n], caches[layer].values[0, :, :n])
    seq.release()
    assert mgr.check() == []


@pytest.mark.timeout(180)
def test_acquire_and_fork_without_l2(lm, pool):
    """PoolSequence.acquire: the longest published prefix of whole blocks, in
    one call (a manager without an L2, ``mgr.l2`` None, as without ``l2=``);
    fork: the same blocks in a new table, decoding apart like mlx-lm."""
    assert pool.l2 is None
    prompt = encode(lm, TEXT * 3)
    n = 8
    ref = generate(lm.model, prompt, make_prompt_cache(lm.model), n)
    seq = P.PoolSequence.acquire(pool, "first", prompt[:-1])
    assert seq.stored == 0 and seq.chain is None
    caches = P.make_pool_cache(lm.model, seq)
    assert generate(lm.model, prompt, caches, n) == ref
    seq.commit()
    seq.publish(prompt + ref)
    seq.release()

    seq = P.PoolSequence.acquire(pool, "again", prompt[:-1])
    full = (len(prompt) - 1) // BS * BS
    assert seq.stored == seq.table.num_tokens == full > 0
    assert seq.published == full // BS and seq.ids == seq.table.block_ids
    caches = P.make_pool_cache(lm.model, seq)
    assert P.load_prefix(caches) == full
    y = prefill(lm.model, prompt[full:], caches)
    seq.commit()
    fork = seq.fork("again-fork")
    assert fork.table.block_ids == seq.table.block_ids and fork.stored == seq.stored
    fcaches = []
    for c in caches:
        f = P.PoolKVCache(fork, c.layer)
        f.keys, f.values, f.offset = c.keys[..., :c.offset, :], c.values[..., :c.offset, :], c.offset
        fcaches.append(f)
    a = [y] + [step1(lm.model, y, caches)]
    b = [y] + [step1(lm.model, y, fcaches)]
    seq.commit()
    fork.commit()
    assert a == b == ref[:2]
    assert_pool_holds(pool, seq, single_kv(caches))
    assert_pool_holds(pool, fork, single_kv(fcaches))
    with pytest.raises(ValueError):
        P.PoolSequence.acquire(pool, "again", prompt[:-1])        # the id is taken
    fork.release()
    seq.release()
    assert pool.check() == []

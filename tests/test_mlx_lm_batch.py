"""shmcache.models.mlx_lm's batches: ``PoolBatchKVCache`` as mlx-lm's
``BatchKVCache`` over pooled sequences (merge, filter, extend, extract, a
right-padded prefill in chunks as mlx-lm's BatchGenerator does it).

The models, fixtures and checks are ``tests/_mlx_lm.py``'s: each row's
tokens must be its sequence's decoded alone and the pool must hold exactly
(bitwise) each row's K/V.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402  (conftest.py imported shmcache, and so its BLAS, first)
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

from shmcache.models import mlx_lm as P  # noqa: E402

from _mlx_lm import (BS, TEXT, alone, assert_pool_holds, encode, prefill,  # noqa: E402
                     single_kv, start_seq, step1)
from _mlx_lm import lm, pool, pools  # noqa: E402  (pytest fixtures)

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["lm", "pool", "pools"]


# ----------------------------------------------------------------- helpers
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

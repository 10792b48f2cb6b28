"""shmcache.models.mlx_lm: mlx-lm's KVCache written through to a pool, one sequence
at a time: cold, warm from a prefix another process published, forked three
ways, publishing while decoding, trim, acquire; and the models and pools it
refuses. Batches (``PoolBatchKVCache``) are in ``test_mlx_lm_batch.py``.

The models, fixtures and checks are ``tests/_mlx_lm.py``'s: the tokens must
be mlx-lm's own and the pool must hold exactly (bitwise) the K/V the model
computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shmcache  # (first: the fast BLAS before mlx)

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache  # noqa: E402

from shmcache.models import mlx_lm as P  # noqa: E402

from _mlx_lm import (BS, TEXT, alone, assert_pool_holds, encode, eq, generate,  # noqa: E402
                     prefill, single_kv, start_seq, step1)
from _mlx_lm import lm, pool, pools  # noqa: E402  (pytest fixtures)

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["lm", "pool", "pools"]

ROOT = Path(__file__).resolve().parent.parent


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
from shmcache.models import mlx_lm as P

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

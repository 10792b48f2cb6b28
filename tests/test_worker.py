"""The generation worker over a real shared pool (small model).

Cross-process tests start real worker processes (multiprocess, spawn) that
attach to the pool by name.
"""

from __future__ import annotations

import multiprocess as mp
import numpy as np
import pytest

from workers.model import InMemoryKVCache, Model, ModelConfig, decode_step, prefill, sample
from workers.protocol import Request
from workers.seam import PagedKVSeam
from workers.worker import Worker

CFG = dict(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, vocab_size=128)
BS = 8


def make_pool_for_model(make_pool, max_blocks=64, caching=True):
    return make_pool(block_size=BS, max_blocks=max_blocks, enable_caching=caching,
                     num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


def serve(w: Worker, reqs) -> dict:
    for r in reqs:
        w.submit(r)
    out = {}
    while w.busy:
        for d in w.step():
            out[d.id] = d
    return out


@pytest.fixture(scope="module")
def model():
    return Model(ModelConfig(**CFG))


def test_seam_matches_in_memory_reference(make_pool, model):
    mgr = make_pool_for_model(make_pool)
    toks = prompt(29)
    table = mgr.create_block_table("r")
    seam = PagedKVSeam(mgr, table)
    ref = InMemoryKVCache(2)
    a = prefill(model, toks, seam, BS)
    b = prefill(model, toks, ref, BS)
    assert np.allclose(np.array(a), np.array(b), atol=1e-5)
    assert table.num_tokens == 29 and len(table) == 4
    k, v = mgr.read_kv(table.block_ids, 1)
    assert np.array_equal(np.array(k[:, :29]), np.array(ref.keys[1]))
    assert np.array_equal(np.array(v[:, :29]), np.array(ref.values[1]))
    x = decode_step(model, 5, seam)
    y = decode_step(model, 5, ref)
    assert np.allclose(np.array(x), np.array(y), atol=1e-5) and seam.offset == 30


def test_fork_shares_full_blocks_and_copies_only_the_partial_one(make_pool, model):
    mgr = make_pool_for_model(make_pool)
    w = Worker(0, mgr, model)
    req = Request(0, prompt(29), max_new_tokens=3, n=3, temperature=0.9, seed=1)
    w.submit(req)
    w.step()                       # admitted, first chunk
    st = w.running[0]
    while not st.outputs:
        w.step()
    ids = [t.block_ids for t in st.tables]
    assert len(ids) == 3 and ids[0] == ids[1] == ids[2]      # forked: all shared
    cow_before = mgr.get_stats().cow_copies
    w.step()                                                   # one decode step each
    ids = [t.block_ids for t in st.tables]
    assert ids[0][:3] == ids[1][:3] == ids[2][:3]              # full blocks still shared
    assert len({i[3] for i in ids}) == 3                       # the partial one was copied
    assert mgr.get_stats().cow_copies - cow_before == 2        # the last holder keeps the original
    serve(w, [])
    assert mgr.check() == [] and mgr.free_blocks == mgr.max_blocks - 1


def test_tenants_with_different_salts_never_share_blocks(make_pool, model):
    mgr = make_pool_for_model(make_pool)
    w = Worker(0, mgr, model)
    p = prompt(40)
    a = serve(w, [Request(0, p, 2, salt="a")])[0]
    b = serve(w, [Request(1, p, 2, salt="b")])[1]
    a2 = serve(w, [Request(2, p, 2, salt="a")])[2]
    plain = serve(w, [Request(3, p, 2)])[3]
    assert a.cached_tokens == 0 and b.cached_tokens == 0 and plain.cached_tokens == 0
    assert a2.cached_tokens == 32                             # same salt: shared
    assert a.outputs == b.outputs == a2.outputs == plain.outputs


def test_outputs_do_not_depend_on_the_cache(make_pool, model):
    reqs = [Request(i, prompt(20) + prompt(5 + i, seed=i + 1), 5, n=1 + i % 2,
                    temperature=0.7 * (i % 2), seed=3) for i in range(4)]
    on = serve(Worker(0, make_pool_for_model(make_pool), model), reqs)
    off = serve(Worker(0, make_pool_for_model(make_pool, caching=False), model), reqs)
    tight = serve(Worker(0, make_pool_for_model(make_pool, max_blocks=8), model), reqs)
    assert {i: d.outputs for i, d in on.items()} == {i: d.outputs for i, d in off.items()}
    assert {i: d.outputs for i, d in on.items()} == {i: d.outputs for i, d in tight.items()}
    assert sum(d.cached_tokens for d in on.values()) > 0
    assert sum(d.preemptions for d in tight.values()) > 0


def test_greedy_output_equals_the_in_memory_reference(make_pool, model):
    mgr = make_pool_for_model(make_pool)
    p = prompt(27)
    got = serve(Worker(0, mgr, model), [Request(0, p, 6)])[0].outputs[0]
    cache = InMemoryKVCache(2)
    toks = [sample(prefill(model, p, cache, BS), 0, None)]
    while len(toks) < 6:
        toks.append(sample(decode_step(model, toks[-1], cache), 0, None))
    assert got == toks


def _serve_in_process(name, reqs, q):
    import shmcache as sc
    from workers.model import Model as M, ModelConfig as C
    from workers.worker import Worker as W
    mgr = sc.attach(name)
    try:
        w = W(1, mgr, M(C(**CFG)))
        for r in reqs:
            w.submit(r)
        done = {}
        while w.busy:
            for d in w.step():
                done[d.id] = (d.cached_tokens, d.outputs)
        q.put(done)
    finally:
        mgr.close()


@pytest.mark.timeout(120)
def test_block_published_by_one_worker_is_used_by_another(make_pool):
    mgr = make_pool_for_model(make_pool)
    ctx = mp.get_context("spawn")
    p = prompt(41)
    results = []
    for i in range(2):
        q = ctx.Queue()
        proc = ctx.Process(target=_serve_in_process, args=(mgr.name, [Request(i, p, 3)], q))
        proc.start()
        try:
            results.append(q.get(timeout=90)[i])
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0
    (c0, o0), (c1, o1) = results
    assert c0 == 0 and c1 == 40              # every full block the first one published
    assert o0 == o1
    assert mgr.check() == [] and mgr.get_stats().allocated_blocks == 1
    assert len(mgr._cached_ids()) == 5       # they stay cached, free, for the next request

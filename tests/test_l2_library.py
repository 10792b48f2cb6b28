"""The L2 tier on the library API: ``shmcache.create_pool(..., l2=...)`` /
``shmcache.attach(..., l2=...)`` and ``shmcache.models.mlx_lm`` using ``mgr.l2``.

Two pools under different names stand for two hosts, both on one real
``redis-server`` (``tests/_redis.py``; SKIPPED, with the reason, where there
is none). A real mlx-lm model (the demo llama, random weights) computes a
prefix through pool A; pool B loads it from L2, and the tokens are mlx-lm's
own with no cache at all.
"""

from __future__ import annotations

import gc
import os
import time

import pytest

import shmcache  # noqa: F401  (first: the fast BLAS before mlx)
from shmcache.shm import segment

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from conftest import new_name  # noqa: E402
from shmcache.models import mlx_lm as P  # noqa: E402
from shmcache.l2 import L2Tier  # noqa: E402

from _l2 import redis_srv  # noqa: E402,F401  (a pytest fixture)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]

BS = 16
SECRET = "one cluster"


@pytest.fixture
def rclient(redis_srv):
    c = redis_srv.client()
    c.flushdb()
    yield c
    c.close()


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from shmcache.models.demo_model import build_model_dir
    path = build_model_dir(tmp_path_factory.mktemp("l2lib") / "tiny-llama", "llama")
    model, tok = load(str(path))
    return path, model, P.pool_layout(model)


@pytest.fixture
def hosts():
    """Factory: hosts(**kw) -> creator manager of a new pool (destroyed at teardown)."""
    made = []

    def make(**kw):
        name = new_name("l2lib")
        m = shmcache.create_pool(name, **kw)
        made.append(m)
        return m
    yield make
    for m in made:
        try:
            assert m.check() == []
        finally:
            m.destroy()
            segment.unlink(m.name)


def generate(model, prompt, caches, n):
    return [int(y) for y, _ in generate_step(mx.array(prompt), model, prompt_cache=caches,
                                             prefill_step_size=BS, max_tokens=n)]


def serve_one(mgr, model, prompt, n, rid):
    """What a worker does: the cached prefix (L1, then L2), the rest
    computed, full blocks published (and queued for L2). Returns (tokens,
    cached tokens)."""
    seq = P.PoolSequence.acquire(mgr, rid, prompt[:-1])
    caches = P.make_pool_cache(model, seq)
    cached = P.load_prefix(caches)
    out = generate(model, prompt[cached:], caches, n)
    seq.commit()
    seq.publish(prompt + out)
    seq.release()
    return out, cached


def test_host_b_loads_a_prefix_computed_on_host_a(redis_srv, rclient, lm, hosts):
    path, model, lay = lm
    kw = dict(block_size=BS, max_blocks=64, l2=redis_srv.url, l2_model=path,
              cluster_secret=SECRET, **lay)
    a, b = hosts(**kw), hosts(**kw)
    assert isinstance(a.l2, L2Tier) and a.l2.codec.layout.model_id.startswith("tiny-llama@")
    prompt = [(7 * i + 3) % 200 + 20 for i in range(5 * BS + 5)]    # prompt[:-1]: 5 blocks
    n = 12
    ref = generate(model, prompt, make_prompt_cache(model), n)

    out, cached = serve_one(a, model, prompt, n, "on-a")
    assert (out, cached) == (ref, 0)
    assert a.l2.store.flush(10)
    assert a.l2.stats()["writes"] >= 5 and rclient.dbsize() >= 5

    out, cached = serve_one(b, model, prompt, n, "on-b")        # B's pool never saw it
    assert cached == 5 * BS
    assert out == ref                                            # the tokens of no cache at all
    assert b.l2.stats()["hits"] == 5
    blocks, hit = b.acquire_computed_blocks(prompt[:-1])
    assert hit == 5 * BS                                         # now in B's L1
    b.free_block_batch(blocks)
    # the pool-wide counters (what `shmcache inspect` shows) follow, from the writer thread
    deadline = time.monotonic() + 5
    while b.l2_counters()["hits"] < 5:
        assert time.monotonic() < deadline, b.l2_counters()
        time.sleep(0.05)
    assert b.l2_counters()["read_bytes"] == b.l2.stats()["read_bytes"] > 0


def test_without_a_cluster_secret_a_pool_shares_only_with_itself(redis_srv, rclient, lm, hosts,
                                                                 monkeypatch):
    monkeypatch.delenv("SHMCACHE_CLUSTER_SECRET", raising=False)
    path, model, lay = lm
    kw = dict(block_size=BS, max_blocks=64, l2=redis_srv.url, l2_model="tiny@1", **lay)
    a, b = hosts(**kw), hosts(**kw)
    prompt = [(5 * i + 1) % 200 + 20 for i in range(3 * BS + 2)]
    ref = generate(model, prompt, make_prompt_cache(model), 6)
    assert serve_one(a, model, prompt, 6, "a") == (ref, 0)
    assert a.l2.store.flush(10)
    assert serve_one(b, model, prompt, 6, "b") == (ref, 0)      # another pool: nothing shared
    # another manager of pool A (another process's, after an L1 eviction) does share
    a.reset_prefix_cache()
    other = shmcache.attach(a.name, l2=redis_srv.url, l2_model="tiny@1")
    try:
        out, cached = serve_one(other, model, prompt, 6, "a2")
        assert (out, cached) == (ref, 3 * BS)
    finally:
        other.close()


def test_close_stops_the_tier_and_counts_into_the_pool(redis_srv, rclient, hosts):
    m = hosts(block_size=4, max_blocks=16, l2=redis_srv.url, l2_model="m@1")
    other = shmcache.attach(m.name, l2=redis_srv.url, l2_model="m@1")
    store = other.l2.store
    assert store._thread.is_alive()
    store.c.add("rejected", 3)                  # counted, not yet flushed
    other.close()
    assert not store._thread.is_alive()
    assert m.l2_counters()["rejected"] == 3     # the last deltas went in before detaching
    # a manager dropped without close stops its tier too (its thread holds it weakly)
    dropped = shmcache.attach(m.name, l2=redis_srv.url, l2_model="m@1")
    store = dropped.l2.store
    del dropped
    gc.collect()
    deadline = time.monotonic() + 5
    while store._thread.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # `with` destroys and stops it
    with shmcache.create_pool(new_name("l2lib"), block_size=4, max_blocks=16,
                              l2=redis_srv.url, l2_model="m@1") as w:
        store, name = w.l2.store, w.name
    assert not store._thread.is_alive() and name not in segment.list_names()
    # without l2 the attribute is None
    plain = shmcache.attach(m.name)
    assert plain.l2 is None
    plain.close()


def test_bad_l2_arguments_leave_no_pool(redis_srv):
    name = new_name("l2bad")
    with pytest.raises(ValueError, match="l2_model"):
        shmcache.create_pool(name, block_size=4, max_blocks=16, l2=redis_srv.url)
    assert name not in segment.list_names()
    with pytest.raises(ValueError, match="redis://"):
        shmcache.create_pool(name, block_size=4, max_blocks=16, l2="http://x:1", l2_model="m")
    with pytest.raises(ValueError, match="need l2"):
        shmcache.create_pool(name, block_size=4, max_blocks=16, cluster_secret="s")
    assert name not in segment.list_names()
    assert not os.path.exists(segment.path_for(name))

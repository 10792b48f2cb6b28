"""The L2 tier's library (``shmcache.l2``): keys, values, the Redis client, the pool glue.

The codec tests need nothing; the others run against a real
``redis-server`` started here (``tests/_redis.py``) and are skipped, with
the reason, when there is none. Pools are real named pools (``make_pool``).
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import numpy as np
import pytest

from shmcache import l2 as L2
from shmcache.l2 import Codec, KVLayout, L2Tier, RedisL2, Rejected

from _redis import SKIP_REASON, RedisServer, find_redis_server, free_port, redis_or_skip

pytestmark = pytest.mark.timeout(120)

SECRET = b"cluster secret"
LAY = KVLayout("tiny@abc", "float32", 4, 2, 2, 8)


def payload(codec: Codec, seed: int, chunk: int = 0) -> bytes:
    lo, hi = codec.chunks[chunk]
    n = (hi - lo) * codec.layout.layer_bytes // codec.layout.np_dtype.itemsize
    return np.random.default_rng(seed).integers(0, 60000, n).astype(codec.layout.np_dtype).tobytes()


# ------------------------------------------------------------------ codec
def test_value_round_trip_and_header():
    c = Codec(LAY, SECRET)
    h = c.chain(list(range(8)), 2)[1]
    data = payload(c, 1)
    v = c.encode(h, 0, data)
    assert len(v) == L2.HEADER_BYTES + LAY.block_bytes
    assert v[:6] == b"SHMCKV" and v[6] == L2.FORMAT_VERSION
    assert bytes(c.decode(v, h, 0)) == data
    a = c.chunk_array(c.decode(v, h, 0), 0)
    assert a.shape == (2, 2, 2, 4, 8) and a.dtype == np.float32


def _corruptions(c: Codec, h: bytes, v: bytes):
    other = Codec(KVLayout("tiny@abc", "float32", 4, 2, 2, 16), SECRET)     # head_dim 16
    hdr = L2._HDR
    fields = list(hdr.unpack_from(v))
    yield "truncated header", v[:20]
    yield "truncated payload", v[:-1]
    yield "extra bytes", v + b"\0"
    yield "a payload byte flipped", v[:-5] + bytes([v[-5] ^ 1]) + v[-4:]
    yield "a header byte flipped", v[:30] + bytes([v[30] ^ 0x40]) + v[31:]
    yield "the MAC flipped", v[:L2._MAC_OFF] + bytes([v[L2._MAC_OFF] ^ 1]) + v[L2._MAC_OFF + 1:]
    yield "bad magic", b"XXXXXX" + v[6:]
    bad = list(fields); bad[1] = 2
    yield "version 2", hdr.pack(*bad) + v[hdr.size:]
    yield "another block's value", c.encode(c.chain([9] * 8, 2)[1], 0, v[hdr.size:])
    yield "another layout's value", other.encode(h, 0, bytes(other.layout.block_bytes))
    yield "another secret's value", Codec(LAY, b"other").encode(h, 0, v[hdr.size:])
    bad = list(fields); bad[9] = fields[9] - 4               # payload length lies
    yield "a lying length", hdr.pack(*bad) + v[hdr.size:-4]
    yield "empty", b""


def test_every_corruption_is_rejected():
    c = Codec(LAY, SECRET)
    h = c.chain(list(range(8)), 2)[1]
    v = c.encode(h, 0, payload(c, 2))
    seen = 0
    for what, bad in _corruptions(c, h, v):
        with pytest.raises(Rejected):
            c.decode(bad, h, 0)
            pytest.fail(f"{what}: accepted")
        seen += 1
    assert seen == 13


def test_keys_are_deterministic_and_separated_by_secret_salt_tokens_and_layout():
    toks = list(range(100, 120))                              # 5 blocks of 4
    a = Codec(LAY, SECRET)
    assert a.chain(toks, 5) == Codec(LAY, SECRET).chain(toks, 5)      # another process, same keys
    assert a.chain(toks, 5, prev=a.chain(toks, 2)) == a.chain(toks, 5)
    assert a.chain(toks, 3) == a.chain(toks, 5)[:3]
    assert all(len(h) == 16 for h in a.chain(toks, 5))
    sets = {
        "base": a.chain(toks, 5),
        "salt t1": a.chain(toks, 5, ("t1",)),
        "salt t2": a.chain(toks, 5, ("t2",)),
        "secret": Codec(LAY, b"another").chain(toks, 5),
        "model": Codec(KVLayout("other@abc", "float32", 4, 2, 2, 8), SECRET).chain(toks, 5),
        "dtype": Codec(KVLayout("tiny@abc", "float16", 4, 2, 2, 8), SECRET).chain(toks, 5),
        "layers": Codec(KVLayout("tiny@abc", "float32", 4, 3, 2, 8), SECRET).chain(toks, 5),
        "heads": Codec(KVLayout("tiny@abc", "float32", 4, 2, 1, 8), SECRET).chain(toks, 5),
        "chunking": Codec(LAY, SECRET, max_value_bytes=LAY.layer_bytes).chain(toks, 5),
    }
    flat = [h for hs in sets.values() for h in hs]
    assert len(set(flat)) == len(flat), "two chains share a hash"
    # a changed token changes its block's key and every later one, not earlier ones
    t2 = list(toks)
    t2[9] += 1
    b = a.chain(t2, 5)
    assert b[:2] == sets["base"][:2] and all(x != y for x, y in zip(b[2:], sets["base"][2:]))
    # the layout is in the Redis key's prefix (an operator can tell layouts apart)
    k1 = a.keys(sets["base"][0])[0]
    k2 = Codec(KVLayout("tiny@abc", "float16", 4, 2, 2, 8), SECRET).keys(sets["base"][0])[0]
    assert k1.startswith(b"shmcache:kv1:") and k1.split(b":")[2] != k2.split(b":")[2]
    # a block size 8 chain is not a block size 4 chain
    c8 = Codec(KVLayout("tiny@abc", "float32", 8, 2, 2, 8), SECRET)
    assert not set(c8.chain(toks[:16], 2)) & set(a.chain(toks[:16], 4))


def test_large_blocks_are_cut_into_layer_chunks():
    lay = KVLayout("big@x", "bfloat16", 4, 5, 2, 8)
    c = Codec(lay, SECRET, max_value_bytes=2 * lay.layer_bytes)
    assert c.chunks == [(0, 2), (2, 4), (4, 5)]
    h = c.chain([1] * 4, 1)[0]
    keys = c.keys(h)
    assert len(keys) == 3 and keys[1].endswith(b":c1")
    for j in range(3):
        v = c.encode(h, j, payload(c, j, j))
        assert bytes(c.decode(v, h, j)) == payload(c, j, j)
        with pytest.raises(Rejected):
            c.decode(v, h, (j + 1) % 3)                  # a chunk under another chunk's key


def test_model_identity_changes_with_the_weights(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    a = L2.model_identity(d)
    assert a.startswith("m@") and a == L2.model_identity(d)
    (d / "model.safetensors").write_bytes(b"y" * 1000)
    assert L2.model_identity(d) != a
    # another MLX or CPU architecture: another identity (the K/V bits may differ)
    assert L2.model_identity(d, runtime="mlx-0.1-arm64") != L2.model_identity(d)


def test_check_url_and_redact():
    assert L2.check_url("redis://127.0.0.1:6379/0")
    assert L2.check_url("rediss://h:1")
    for bad in ("http://h:1", "redis://h:port", "redis://:1", "redis://h:1/db"):
        with pytest.raises(ValueError):
            L2.check_url(bad)
    assert "hunter2" not in L2.redact("redis://user:hunter2@h:1/0")
    assert L2.redact("redis://h:1/0") == "redis://h:1/0"


# ------------------------------------------------------------- with Redis
@pytest.fixture(scope="module")
def redis_srv():
    srv = redis_or_skip()
    yield srv
    srv.stop()


@pytest.fixture
def rclient(redis_srv):
    if not redis_srv.alive:
        redis_srv.start()
    c = redis_srv.client()
    c.flushdb()
    yield c
    c.close()


@pytest.fixture
def stores():
    made = []

    def make(url, codec=None, **kw):
        s = RedisL2(url, codec or Codec(LAY, SECRET), **kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close(flush_s=0)


def blocks_array(codec: Codec, n: int, seed: int) -> np.ndarray:
    lay = codec.layout
    return np.random.default_rng(seed).standard_normal(
        (lay.num_layers, n, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)).astype(lay.np_dtype)


@pytest.mark.redis
def test_put_then_lookup_stops_at_the_first_miss(redis_srv, rclient, stores):
    s = stores(redis_srv.url)
    c = s.codec
    chain = c.chain(list(range(40)), 10)
    arr = blocks_array(c, 6, 3)
    assert s.put(chain[:6], arr)
    assert s.flush(10)
    assert s.stats()["writes"] == 6 and rclient.dbsize() == 6
    got = s.lookup(chain)
    assert len(got) == 6
    for i, parts in enumerate(got):
        assert np.array_equal(c.chunk_array(parts[0], 0), arr[:, i])
    st = s.stats()
    assert (st["hits"], st["misses"], st["lookups"]) == (6, 4, 1)
    assert st["read_bytes"] == 6 * (L2.HEADER_BYTES + LAY.block_bytes)
    assert st["written_bytes"] == st["read_bytes"]
    # a hole in the chain ends the run there (LRU may evict any block)
    rclient.delete(c.keys(chain[2])[0])
    assert len(s.lookup(chain)) == 2
    # the TTL is set when asked for
    t = stores(redis_srv.url, ttl=100)
    t.put(chain[6:7], blocks_array(c, 1, 4))
    assert t.flush(10)
    assert 0 < rclient.ttl(c.keys(chain[6])[0]) <= 100
    assert rclient.ttl(c.keys(chain[0])[0]) == -1


@pytest.mark.redis
def test_lookup_across_many_batches(redis_srv, rclient, stores):
    c = Codec(LAY, SECRET)
    s = stores(redis_srv.url, c, batch_bytes=3 * LAY.block_bytes)   # 2 blocks per MGET
    chain = c.chain(list(range(4 * 21)), 21)
    s.put(chain, blocks_array(c, 21, 5))
    assert s.flush(10)
    assert len(s.lookup(chain)) == 21


@pytest.mark.redis
def test_chunked_values_round_trip_through_redis(redis_srv, rclient, stores):
    lay = KVLayout("big@x", "bfloat16", 4, 5, 2, 8)
    c = Codec(lay, SECRET, max_value_bytes=2 * lay.layer_bytes)
    s = stores(redis_srv.url, c)
    chain = c.chain(list(range(12)), 3)
    arr = blocks_array(c, 3, 6)
    s.put(chain, arr)
    assert s.flush(10)
    assert rclient.dbsize() == 9
    got = s.lookup(chain)
    assert len(got) == 3
    for i, parts in enumerate(got):
        whole = np.concatenate([c.chunk_array(p, j) for j, p in enumerate(parts)])
        assert np.array_equal(whole, arr[:, i])
    rclient.delete(c.keys(chain[1])[2])                 # one chunk gone: the block is a miss
    assert len(s.lookup(chain)) == 1


@pytest.mark.redis
def test_corrupt_truncated_and_wrong_layout_values_are_rejected_and_counted(
        redis_srv, rclient, stores, caplog):
    s = stores(redis_srv.url)
    c = s.codec
    chain = c.chain(list(range(12)), 3)
    s.put(chain, blocks_array(c, 3, 7))
    assert s.flush(10)
    key = c.keys(chain[1])[0]
    good = rclient.get(key)
    other = Codec(KVLayout("tiny@abc", "float16", 4, 2, 2, 8), SECRET)
    bads = [good[:-7],                                                  # truncated
            good[:-3] + bytes([good[-3] ^ 0x10]) + good[-2:],          # a flipped bit
            other.encode(chain[1], 0, bytes(other.layout.block_bytes)),  # another layout
            c.encode(chain[0], 0, good[L2.HEADER_BYTES:]),             # another key's value
            b"garbage"]
    with caplog.at_level(logging.WARNING, logger="shmcache.l2"):
        for i, bad in enumerate(bads, 1):
            rclient.set(key, bad)
            assert len(s.lookup(chain)) == 1, f"value {i} was accepted"
            assert s.stats()["rejected"] == i
    warned = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(warned) == 1                              # once, not per value
    rclient.set(key, good)
    assert len(s.lookup(chain)) == 3


@pytest.mark.redis
def test_redis_down_never_raises_is_counted_warned_once_and_retried(stores, caplog):
    binary = find_redis_server()
    if binary is None:
        pytest.skip(SKIP_REASON)
    port = free_port()                      # nothing listens there (yet)
    url = f"redis://127.0.0.1:{port}/0"
    s = stores(url, timeout=0.05, retry_s=0.5)
    c = s.codec
    chain = c.chain(list(range(8)), 2)
    with caplog.at_level(logging.WARNING, logger="shmcache.l2"):
        t0 = time.monotonic()
        assert s.lookup(chain) == []
        assert time.monotonic() - t0 < 0.5
        st = s.stats()
        assert st["outages"] == 1 and st["errors"] + st["timeouts"] >= 1 and st["up"] == 0
        # while down: no network at all, and writes are dropped (counted)
        for _ in range(5):
            assert s.lookup(chain) == []
        assert not s.put(chain, blocks_array(c, 2, 8))
        assert s.stats()["dropped"] == 2
        assert s.stats()["lookups"] == 1
        time.sleep(0.6)
        assert s.lookup(chain) == []            # tried again: still down, not warned again
        assert s.stats()["outages"] == 1
        srv = RedisServer(binary, port)         # Redis comes (back)
        try:
            time.sleep(0.6)
            assert s.put(chain, blocks_array(c, 2, 9))
            assert s.flush(10)
            assert s.stats()["up"] == 1 and s.stats()["writes"] == 2
            assert len(s.lookup(chain)) == 2
            # killed: the next lookup fails fast, a second outage
            srv.kill()
            t0 = time.monotonic()
            assert s.lookup(chain) == []
            assert time.monotonic() - t0 < 0.5
            assert s.stats()["outages"] == 2
        finally:
            srv.stop()
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("is unavailable" in m for m in msgs) == 2, msgs
    assert sum("answers again" in m for m in msgs) == 1, msgs


@pytest.mark.redis
def test_a_redis_that_does_not_answer_costs_one_timeout(redis_srv, rclient, stores):
    s = stores(redis_srv.url, timeout=0.1, retry_s=30)
    chain = s.codec.chain(list(range(8)), 2)
    assert s.ping()
    redis_srv.pause()
    try:
        t0 = time.monotonic()
        assert s.lookup(chain) == []
        took = time.monotonic() - t0
        assert took < 0.5, took
        assert s.stats()["timeouts"] == 1 and s.stats()["up"] == 0
        t0 = time.monotonic()
        assert s.lookup(chain) == []            # down: not even tried
        assert time.monotonic() - t0 < 0.01
    finally:
        redis_srv.resume()


@pytest.mark.redis
def test_a_full_queue_drops_instead_of_waiting(redis_srv, rclient, stores):
    c = Codec(LAY, SECRET)
    s = stores(redis_srv.url, c, queue_bytes=2 * LAY.block_bytes)
    redis_srv.pause()                       # the writer's send stalls: the queue fills
    try:
        chain = c.chain(list(range(4 * 40)), 40)
        t0 = time.monotonic()
        ok = [s.put(chain[i:i + 1], blocks_array(c, 1, i)) for i in range(40)]
        assert time.monotonic() - t0 < 0.5
        assert not all(ok) and s.stats()["dropped"] >= 30
    finally:
        redis_srv.resume()


# --------------------------------------------------------- with pools
def _fill(mgr, tokens, extra=None, seed=0):
    """A table of ``tokens`` (whole blocks) with random K/V, published in L1."""
    bs, lay = mgr.block_size, mgr.layout
    t = mgr.create_block_table(f"fill-{seed}-{len(tokens)}")
    got = mgr.prepare_append(t, len(tokens))
    rng = np.random.default_rng(seed)
    for b in got:
        for layer in range(lay.num_layers):
            k, v = (mx.array(rng.standard_normal((lay.num_kv_heads, bs, lay.head_dim))
                             .astype(np.float32)) for _ in range(2))
            mgr.write_kv(b.block_id, layer, k, v)
    mgr.cache_full_blocks(t.block_ids, tokens, 0, len(tokens) // bs, extra)
    return t


POOL = dict(block_size=4, max_blocks=32, num_layers=3, num_kv_heads=2, head_dim=8)


@pytest.mark.redis
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefix_written_by_one_pool_is_loaded_by_another_bit_exact(
        redis_srv, rclient, make_pool, dtype, chunked):
    kw = dict(max_value_bytes=1) if chunked else {}         # one layer per value when chunked
    a = make_pool(dtype=dtype, **POOL)
    b = make_pool(dtype=dtype, **POOL)
    ta = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET, **kw)
    tb = L2Tier(b, redis_srv.url, model_id="m@1", secret=SECRET, **kw)
    assert len(ta.codec.chunks) == (3 if chunked else 1)
    try:
        toks = list(range(50, 74))                             # 6 blocks
        t = _fill(a, toks)
        chain = ta.chain(toks, 6)
        ta.write_back(t.block_ids, chain)
        assert ta.store.flush(10)
        # host B: an L1 hit of 2 blocks of its own, then L2
        _fill(b, toks[:8], seed=1)           # (other K/V: B's L1 copy of blocks 0-1 is its own)
        table = b.create_block_table("req")
        blocks, cached = b.acquire_computed_blocks(toks)
        assert cached == 8
        for blk in blocks:
            b.add_block_to_table(table, blk, 4)
        assert tb.load(table, toks, None, 2, tb.chain(toks, 6)) == 4
        assert table.num_tokens == 24
        ids = table.block_ids
        assert (L2.read_blocks(b, ids[2:]).tobytes()          # bit-exact
                == L2.read_blocks(a, t.block_ids[2:]).tobytes())
        for layer in range(3):                                 # and through read_kv
            for x, y in zip(b.read_kv(ids[2:], layer), a.read_kv(t.block_ids[2:], layer)):
                assert mx.array_equal(x, y).item()
        # published in B's L1: the next lookup finds all six there
        assert b.acquire_computed_blocks(toks)[1] == 24
        assert tb.stats()["hits"] == 4 and b.check() == []
        b.delete_block_table("req")
    finally:
        ta.close()
        tb.close()


@pytest.mark.redis
def test_salts_secrets_and_layouts_do_not_share(redis_srv, rclient, make_pool):
    a = make_pool(dtype="float32", **POOL)
    same = make_pool(dtype="float32", **POOL)
    wider = make_pool(dtype="float32", **dict(POOL, head_dim=16))
    tiers = []

    def tier(m, **kw):
        kw = dict(dict(model_id="m@1", secret=SECRET), **kw)
        tiers.append(L2Tier(m, redis_srv.url, **kw))
        return tiers[-1]
    try:
        toks = list(range(16))
        ta = tier(a)
        t = _fill(a, toks, extra=("tenant-1",))
        ta.write_back(t.block_ids, ta.chain(toks, 4, ("tenant-1",)))
        assert ta.store.flush(10)

        def loaded(tr, m, extra):
            table = m.create_block_table(f"r{len(tiers)}-{extra}")
            n = tr.load(table, toks, extra, 0, tr.chain(toks, 4, extra))
            m.delete_block_table(table.request_id)
            return n
        assert loaded(tier(same), same, ("tenant-2",)) == 0          # another tenant
        assert loaded(tier(same), same, None) == 0                   # no tenant
        assert loaded(tier(same, secret=b"x"), same, ("tenant-1",)) == 0   # another secret
        assert loaded(tier(same, model_id="m@2"), same, ("tenant-1",)) == 0  # another model
        assert loaded(tier(wider), wider, ("tenant-1",)) == 0        # another layout
        assert loaded(tier(same), same, ("tenant-1",)) == 4          # the same: shared
    finally:
        for t in tiers:
            t.close()


@pytest.mark.redis
def test_load_with_a_full_pool_loads_nothing_and_leaks_nothing(redis_srv, rclient, make_pool):
    a = make_pool(dtype="float32", **POOL)
    b = make_pool(dtype="float32", **dict(POOL, max_blocks=4))      # 3 usable blocks
    ta = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET)
    tb = L2Tier(b, redis_srv.url, model_id="m@1", secret=SECRET)
    try:
        toks = list(range(20))
        t = _fill(a, toks)
        ta.write_back(t.block_ids, ta.chain(toks, 5))
        assert ta.store.flush(10)
        table = b.create_block_table("r")
        assert tb.load(table, toks, None, 0, tb.chain(toks, 5)) == 0
        assert table.num_tokens == 0 and b.get_stats().allocated_blocks == 1   # the null block
        b.delete_block_table("r")
        assert b.check() == []
    finally:
        ta.close()
        tb.close()


@pytest.mark.redis
def test_counters_reach_the_pool_from_every_tier_without_waiting(redis_srv, rclient, make_pool):
    """Two tiers on one pool (two processes' worth): their counters sum in
    the pool's (layout.C_L2) from the writer thread, within ~0.5 s, and at
    close; the serving calls never flush them themselves."""
    from shmcache import layout
    a = make_pool(dtype="float32", **POOL)
    t1 = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET)
    t2 = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET)
    try:
        toks = list(range(12))
        t = _fill(a, toks)
        t1.write_back(t.block_ids, t1.chain(toks, 3))
        assert t1.store.flush(10)
        assert a.l2_counters()["writes"] in (0, 3)     # not yet, or already flushed
        assert t2.store.lookup(t2.chain(toks, 3)) and t2.stats()["hits"] == 3
        deadline = time.monotonic() + 5
        while a.l2_counters()["hits"] < 3 or a.l2_counters()["writes"] < 3:
            assert time.monotonic() < deadline, a.l2_counters()
            time.sleep(0.05)
        c = a.l2_counters()
        assert set(c) == set(layout.L2_COUNTERS)
        assert (c["writes"], c["hits"], c["lookups"]) == (3, 3, 1)
        assert c["written_bytes"] == t1.stats()["written_bytes"] > 0
        assert c["read_bytes"] == t2.stats()["read_bytes"] == c["written_bytes"]
        # what is counted just before close reaches the pool at close
        t2.store.c.add("rejected", 2)
        t2.close()
        assert a.l2_counters()["rejected"] == 2
    finally:
        t1.close()
        t2.close()

"""End-to-end tests of the Redis tier: two ``shmcache serve`` hosts on one Redis.

"Host A" and "host B" are two real servers (``tests/test_server_e2e.py``'s
``Server``: subprocesses, real workers, each its own pool in /dev/shm under
its own name), both ``--l2`` on one real ``redis-server`` (``tests/_redis.py``;
SKIPPED, with the reason, where there is none) with one ``--cluster-secret``.
Every answer is checked against mlx-lm's own greedy generation
(``Reference``), whether its prefix came from L1, from L2 or was computed.
Teardown checks that each server exits 0 and leaves nothing in /dev/shm.

The tests run in file order on one pair of hosts; the last one kills Redis.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shmcache import l2 as L2
from test_server_e2e import BS, MODEL_NAME, Reference, got, printable, serving

from _redis import redis_or_skip

pytestmark = pytest.mark.redis

SECRET = "the cluster's secret"
WAIT_S = 60


@pytest.fixture(scope="module")
def redis_srv():
    srv = redis_or_skip()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from shmcache.models.demo_model import build_model_dir
    return build_model_dir(tmp_path_factory.mktemp("model") / MODEL_NAME, "llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def hosts(redis_srv, model_dir):
    # a generous --l2-timeout: on a loaded 2-core machine a 50 ms one makes
    # spurious outages (this is about correctness; tests/test_l2_client.py times it)
    args = ("--workers", 1, "--max-blocks", 256, "--l2", redis_srv.url, "--cluster-secret",
            SECRET, "--l2-timeout", 1.0, "--l2-retry", 0.5)
    with serving(model_dir, *args) as a, serving(model_dir, *args) as b:
        assert a.pool_path != b.pool_path
        yield a, b


@pytest.fixture(scope="module")
def codec(model_dir, reference):
    """The hosts' keys and values, computed here independently."""
    from shmcache.models.mlx_lm import pool_layout
    lay = pool_layout(reference.model)
    return L2.Codec(L2.KVLayout(L2.model_identity(model_dir), lay["dtype"], BS, lay["num_layers"],
                                lay["num_kv_heads"], lay["head_dim"]), SECRET.encode())


def wait_metric(srv, name: str, at_least: float, timeout: float = WAIT_S) -> float:
    """The metric once it reaches ``at_least`` (the workers report every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        v = srv.metrics().get(name, 0)
        if v >= at_least:
            return v
        assert time.monotonic() < deadline, f"{name} = {v} < {at_least} after {timeout} s"
        time.sleep(0.1)


def ask(srv, prompt, max_tokens=16, salt=None):
    extra = {"cache_salt": salt} if salt else None
    return srv.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, extra_body=extra)


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def computed_on(srv, prompt, reference, before_writes, salt=None, max_tokens=16):
    """Ask ``srv`` (a cold prompt), check the answer, wait for its write-back."""
    r = ask(srv, prompt, max_tokens, salt)
    assert got(r) == reference.greedy(prompt, max_tokens)
    assert cached(r) == 0
    return wait_metric(srv, "shmcache_l2_writes_total", before_writes + (len(prompt) - 1) // BS)


# -------------------------------------------------------------------- tests
@pytest.mark.timeout(600)
def test_host_b_reuses_a_prefix_computed_on_host_a(hosts, reference):
    a, b = hosts
    rng = random.Random(1501)
    prompt = printable(rng, 100)                  # prompt[:-1]: 6 full blocks
    full = (len(prompt) - 1) // BS * BS
    writes = a.metrics().get("shmcache_l2_writes_total", 0)
    computed_on(a, prompt, reference, writes)

    r = ask(b, prompt)                            # B's pool has never seen it
    assert got(r) == reference.greedy(prompt, 16)
    assert cached(r) == full
    wait_metric(b, "shmcache_l2_hits_total", full // BS)      # (reported every 0.5 s)
    m = b.metrics()
    assert m["shmcache_l2_up"] == 1
    assert m["shmcache_l2_read_bytes_total"] > full // BS * 64 * 1024   # 64 KiB blocks
    assert m["shmcache_l2_rejected_total"] == 0

    # now in B's L1: no L2 lookup at all
    hits = wait_metric(b, "shmcache_l2_hits_total", full // BS)
    lookups = b.metrics()["shmcache_l2_lookups_total"]
    r = ask(b, prompt)
    assert got(r) == reference.greedy(prompt, 16) and cached(r) == full
    time.sleep(1.2)                               # a report from the worker
    m = b.metrics()
    assert m["shmcache_l2_hits_total"] == hits and m["shmcache_l2_lookups_total"] == lookups

    # a longer prompt with that prefix on B: the prefix from its L1, blocks
    # 6 and 7 computed (and written back)
    longer = prompt + printable(rng, 40)          # prompt[:-1]: 8 full blocks
    b_writes = b.metrics()["shmcache_l2_writes_total"]
    r = ask(b, longer)
    assert got(r) == reference.greedy(longer, 16)
    assert cached(r) == full
    wait_metric(b, "shmcache_l2_writes_total", b_writes + 2)
    # and on A: blocks 0-5 from its own L1, 6 and 7 from B's, through L2
    r = ask(a, longer)
    assert got(r) == reference.greedy(longer, 16)
    assert cached(r) == 8 * BS


@pytest.mark.timeout(600)
def test_salted_tenants_do_not_share_through_l2(hosts, reference):
    a, b = hosts
    prompt = printable(random.Random(1502), 90)
    full = (len(prompt) - 1) // BS * BS
    writes = a.metrics().get("shmcache_l2_writes_total", 0)
    computed_on(a, prompt, reference, writes, salt="tenant-1")
    for salt in ("tenant-2", None):
        r = ask(b, prompt, salt=salt)
        assert got(r) == reference.greedy(prompt, 16)
        assert cached(r) == 0, f"tenant-1's prefix reached {salt or 'no tenant'} on B"
    r = ask(b, prompt, salt="tenant-1")          # the same tenant on another host: shared
    assert got(r) == reference.greedy(prompt, 16)
    assert cached(r) == full


@pytest.mark.timeout(600)
def test_corrupt_truncated_and_wrong_layout_values_are_rejected(hosts, reference, redis_srv,
                                                                codec):
    a, b = hosts
    rng = random.Random(1503)
    prompts = [printable(rng, 80) for _ in range(3)]       # 4 full blocks each
    writes = a.metrics().get("shmcache_l2_writes_total", 0)
    for p in prompts:
        writes = computed_on(a, p, reference, writes)
    rc = redis_srv.client()
    keys = [[codec.keys(h)[0] for h in codec.chain(p, 4)] for p in prompts]
    for ks in keys:
        assert all(rc.exists(k) for k in ks), "the hosts' keys are not the documented ones"
    # prompt 0: a payload bit flipped in block 2; prompt 1: block 0 truncated;
    # prompt 2: block 1 holds another layout's value (head_dim 64) under its key
    v = rc.get(keys[0][2])
    rc.setrange(keys[0][2], len(v) - 100, bytes([v[-100] ^ 0x01]))
    rc.set(keys[1][0], rc.get(keys[1][0])[:-1000])
    lay = codec.layout
    other = L2.Codec(L2.KVLayout(lay.model_id, lay.dtype, BS, lay.num_layers, lay.num_kv_heads,
                                 64), SECRET.encode())
    h1 = codec.chain(prompts[2], 2)[1]
    rc.set(keys[2][1], other.encode(h1, 0, bytes(other.layout.block_bytes)))
    rejected = b.metrics().get("shmcache_l2_rejected_total", 0)
    for p, n in zip(prompts, (2, 0, 1)):
        r = ask(b, p)
        assert got(r) == reference.greedy(p, 16), f"the blocks before a bad value: {n}"
        assert cached(r) == n * BS
    wait_metric(b, "shmcache_l2_rejected_total", rejected + 3)
    # B computed the bad blocks and wrote them back: the values are good again
    wait_metric(b, "shmcache_l2_writes_total", 1)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            codec.decode(rc.get(keys[0][2]), codec.chain(prompts[0], 3)[2], 0)
            break
        except L2.Rejected:
            assert time.monotonic() < deadline, "the corrupt value was never rewritten"
            time.sleep(0.1)
    rc.close()


@pytest.mark.timeout(900)
def test_redis_killed_mid_run_then_back(hosts, reference, redis_srv):
    """Redis dies (SIGKILL) while both hosts stream requests (some with
    prefixes in L2): every request completes with the reference's tokens;
    the outage is counted; new requests meanwhile are served from L1 and
    computed. Redis restarts (empty): a prefix computed on A reaches B again."""
    a, b = hosts
    rng = random.Random(1504)
    shared = printable(rng, 120)
    writes = a.metrics().get("shmcache_l2_writes_total", 0)
    computed_on(a, shared, reference, writes)
    jobs = [(a, printable(rng, 60), 120), (b, printable(rng, 70), 120),
            (b, shared + printable(rng, 20), 100), (a, printable(rng, 40), 150)]
    started = threading.Barrier(len(jobs) + 1)

    def stream(job):
        srv, prompt, n = job
        parts = []
        first = True
        for chunk in srv.client().completions.create(model=MODEL_NAME, prompt=prompt,
                                                     max_tokens=n, temperature=0, stream=True):
            parts.extend(c.text for c in chunk.choices)
            if first:
                first = False
                started.wait(120)
        return "".join(parts)

    with ThreadPoolExecutor(len(jobs)) as ex:
        futs = [ex.submit(stream, j) for j in jobs]
        started.wait(120)
        redis_srv.kill()                          # mid-run
        during = [(srv, printable(rng, 50 + 10 * i)) for i, srv in enumerate((a, b, a, b))]
        t0 = time.monotonic()
        for srv, p in during:                      # served while Redis is dead
            r = ask(srv, p)
            assert got(r) == reference.greedy(p, 16)
        assert time.monotonic() - t0 < 120
        r = ask(b, shared)              # its 7 blocks: loaded from L2 into B's L1 by job 2
        assert got(r) == reference.greedy(shared, 16) and cached(r) == 7 * BS
        texts = [f.result(timeout=300) for f in futs]
    for (srv, prompt, n), text in zip(jobs, texts):
        assert text == reference.greedy(prompt, n).text
    for srv in (a, b):
        wait_metric(srv, "shmcache_l2_outages_total", 1)
    deadline = time.monotonic() + WAIT_S
    while a.metrics()["shmcache_l2_up"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert a.get("/health").status_code == 200

    redis_srv.start()                             # back, empty
    time.sleep(1.0)                               # > --l2-retry
    prompt = printable(rng, 100)
    deadline = time.monotonic() + WAIT_S
    writes = a.metrics().get("shmcache_l2_writes_total", 0)
    computed_on(a, prompt, reference, writes)
    r = ask(b, prompt)
    assert got(r) == reference.greedy(prompt, 16)
    assert cached(r) == (len(prompt) - 1) // BS * BS, "L2 was not used again after Redis came back"
    for srv in (a, b):
        deadline = time.monotonic() + WAIT_S
        while srv.metrics()["shmcache_l2_up"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert "is unavailable" in a.log() and "answers again" in a.log()
    assert a.log().count("is unavailable") == 1, a.log()

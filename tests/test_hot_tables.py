"""The C table ops of shmcache._hot (hot_tables.h, hot_append.h, hot_index.h)
against their Python paths (tables.py, prefix.py, index.py): a random
request mix leaves byte-identical shared state through either; the ops
refuse (None, nothing changed) outside a lock hold, on bad arguments, and,
for the fused ops that take the lock themselves, on a stale table or view
(the fused publish, and eviction: tests/test_hot_index.py)."""

from __future__ import annotations

import random

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import lock as shlock
from shmcache.shm.hot_ops import NativeOps
from shmcache.shm.refs import rid_key

from _helpers import LOCK_COUNTERS
from _mutex import python_only


# ------------------------------------------- the table ops: C against Python

def assert_unchanged_but_the_lock(p, before: bytes) -> None:
    """The pool's bytes are ``before``'s, but for the lock word and the
    holds' bookkeeping (the ops count, the last holder, the turns): a
    refused op took and left the lock, and changed nothing else."""
    after = bytearray(p.raw)
    co = p.layout.counters_off
    for a in (L.C_OPS, L.C_HOLDER, L.C_TURN_NEXT, L.C_TURN_NOW):
        after[co + 8 * a:co + 8 * a + 8] = before[co + 8 * a:co + 8 * a + 8]
    after[L.MUTEX_OFF:L.HEADER_SIZE] = before[L.MUTEX_OFF:L.HEADER_SIZE]
    assert bytes(after) == before


def _shared_state(m):
    """The segment's metadata the table ops touch, minus what differs between
    two pools by construction (seeds, times, lock bookkeeping)."""
    p = m.pool
    b = p.blocks
    c = p.counter_array.copy()
    c[LOCK_COUNTERS] = 0
    return (b["ref_count"].tobytes(), b["prev"].tobytes(), b["next"].tobytes(),
            b["flags"].tobytes(), b["token_count"].tobytes(), b["gen"].tobytes(),
            b["hash"].tobytes(), p.chunks.tobytes(), p.slots["loose_head"].tobytes(),
            p.slots["loose_count"].tobytes(), c.tobytes(), p.tables.tobytes(),
            p.tidx.tobytes(), p.hidx.tobytes(), m.internals.holder.refs.loose.buf.tobytes())


def _serve(m, seed: int) -> list:
    """A random serving mix: requests sharing prompt prefixes are created,
    acquire their cached prefix into their table, append (with
    copy-on-write after forks), publish, trim and are deleted, alongside
    loose allocations."""
    rng = random.Random(seed)
    bs = m.block_size
    prompts = [[rng.randrange(50) for _ in range(bs * rng.randint(1, 6))] for _ in range(4)]
    live, loose, log = [], [], []
    for step in range(400):
        op = rng.random()
        try:
            if op < 0.2 or not live:
                rid = f"r{seed}-{step}"
                if rng.random() < 0.5:
                    t = m.create_block_table(rid)       # the fused new_table
                else:
                    with m.pool.lock:                     # table_new in the caller's hold
                        t = m.create_block_table(rid)
                tokens = rng.choice(prompts)[:bs * rng.randint(0, 6)]
                tokens = tokens + [rng.randrange(50) for _ in range(rng.randrange(2 * bs))]
                how = rng.random()
                if how < 0.7:
                    # by table object (the fused acquire) or by request id (a
                    # hold of the caller's around find_chain and table_take)
                    got, n = m.acquire_computed_blocks(tokens, table=t if how < 0.35 else rid)
                else:
                    # the seed's way: a lookup (the fused lookup), then each
                    # block added with a new reference (the fused add_block;
                    # a free cached block is taken out of the free list)
                    got, n = m.get_computed_blocks(tokens)
                    for blk in got:
                        m.add_block_to_table(t, blk, bs)
                log.append(("acq", [b.block_id for b in got], n))
                live.append((rid, t, tokens, n))
            elif op < 0.45:
                rid, t, tokens, n = rng.choice(live)
                k = rng.choice([1, 1, 1, rng.randrange(3 * bs)])
                log.append(("app", [b.block_id for b in m.prepare_append(t, k)]))
            elif op < 0.6:
                rid, t, tokens, n = rng.choice(live)
                full = min(len(tokens), t.num_tokens) // bs
                m.cache_full_blocks(t.block_ids, tokens, n // bs, full)
                log.append(("pub", full))
            elif op < 0.65:
                rid, t, tokens, n = rng.choice(live)
                f = m.fork_block_table(t, f"{rid}-f{step}")
                live.append((f"{rid}-f{step}", f, tokens, 0))
                log.append(("fork", f.block_ids))
            elif op < 0.7:
                rid, t, tokens, n = rng.choice(live)
                log.append(("trim", m.trim_table(t, rng.randrange(2 * bs))))
            elif op < 0.75:
                # a block with fewer tokens than it holds: later tokens land
                # in blocks before the table's last (chunks before its tail)
                rid, t, tokens, n = rng.choice(live)
                for b in m.get_new_blocks(rng.randint(1, 20)):
                    m.add_block_to_table(t, b, rng.randint(0, bs))
                log.append(("add", t.block_ids))
            elif op < 0.8:
                got = m.get_new_blocks(rng.randint(1, 3))
                loose += [b.block_id for b in got]
                log.append(("alloc", loose[-len(got):]))
            elif op < 0.85 and loose:
                m.free_block_batch(loose)
                loose = []
                log.append(("free",))
            else:
                rid, t, tokens, n = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.5:
                    m.delete_block_table(rid)           # the fused delete_table
                else:
                    with m.pool.lock:                     # table_drop in the caller's hold
                        m.delete_block_table(rid)
                log.append(("del", rid))
        except shmcache.OutOfBlocksError as e:
            log.append(("full", type(e).__name__))
    for rid, *_ in live:
        m.delete_block_table(rid)
    m.free_block_batch(loose)
    return log


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
@pytest.mark.parametrize("max_blocks", [40, 200], ids=["tight", "roomy"])
def test_the_c_table_ops_leave_the_same_state_as_the_python_ones(max_blocks):
    kw = dict(block_size=4, max_blocks=max_blocks, max_tables=16)
    a = shmcache.PagedCacheManager(**kw)
    b = shmcache.PagedCacheManager(**kw)
    python_only(b)
    calls = {"table_new": 0, "table_drop": 0, "table_take": 0, "table_append": 0,
             "append": 0, "acquire": 0, "new_table": 0, "delete_table": 0, "find_chain": 0,
             "publish": 0, "add_block": 0, "lookup": 0}
    a.pool.ops = NativeOps(_Counted(a.pool.native, calls), a.pool.c, a.pool.t_claim)
    try:
        b.internals.ledger.root = a.internals.ledger.root                        # same chain hashes in both
        for seed in range(6):
            la, lb = _serve(a, seed), _serve(b, seed)
            assert la == lb
            assert _shared_state(a) == _shared_state(b)
            assert a.check() == [] and b.check() == []
        assert calls["table_drop"] > 20 and calls["acquire"] > 20, calls
        assert calls["append"] > 50 and calls["table_new"] > 20, calls
        assert calls["new_table"] > 20 and calls["delete_table"] > 20, calls
        assert calls["table_take"] > 10 and calls["find_chain"] > 20, calls
        assert calls["publish"] > 20 and calls["lookup"] > 20, calls
        assert calls["add_block"] > 20, calls
    finally:
        a.close()
        b.close()


class _Counted:
    """The pool's native object, counting the table ops that did the work."""

    def __init__(self, native, calls) -> None:
        self._n, self._calls = native, calls

    def __getattr__(self, k):
        f = getattr(self._n, k)
        if k not in self._calls:
            return f

        def counted(*args):
            r = f(*args)
            self._calls[k] += r is not None
            return r
        return counted


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_the_table_ops_refuse_outside_a_lock_hold_and_bad_arguments():
    """They run only inside the caller's lock hold (the lock word names this
    thread), on a live table, with ids that are blocks; else None, and
    nothing changes."""
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    try:
        p, nat = m.pool, m.pool.native
        t = m.create_block_table("t")
        m.prepare_append(t, 6)
        before = bytes(p.raw)
        assert nat.table_drop(t.internals.table) is None                  # lock not held
        assert nat.table_append(t.internals.table, 1, 4, 0.0) is None
        assert nat.table_take(t.internals.table, [5], 0.0, 4) is None
        assert nat.table_new(b"u", 7, p.slot) is None
        with p.lock:
            raw, h = rid_key("t")
            assert nat.table_new(raw, h, p.slot) is None     # taken
            assert nat.table_new(b"", 7, p.slot) is None
            assert nat.table_new(b"a\x00b", 7, p.slot) is None
            assert nat.table_drop(t.internals.table + 1) is None          # not a live table
            assert nat.table_drop(-1) is None and nat.table_drop(10**6) is None
            assert nat.table_append(t.internals.table, 0, 4, 0.0) is None     # (the Python path's)
            for bad in ([0], [32], [True], ["1"], [10**20]):
                assert nat.table_take(t.internals.table, bad, 0.0, 4) is None, bad
            assert nat.find_chain([b"short"]) is None
            assert nat.find_chain([]) == []
        assert_unchanged_but_the_lock(p, before)
        m.delete_block_table("t")
        assert m.check() == [] and m.free_blocks == 31
    finally:
        m.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_c_append_into_blocks_before_the_tail_chunk_matches_python():
    """Tokens landing in chunks before the tail's (a table holding more
    blocks than its tokens fill): table_append (here through the fused
    append, which takes the lock itself) walks the chain."""
    a = shmcache.PagedCacheManager(block_size=4, max_blocks=64)
    b = shmcache.PagedCacheManager(block_size=4, max_blocks=64)
    python_only(b)
    calls = {"append": 0}
    a.pool.ops = NativeOps(_Counted(a.pool.native, calls), a.pool.c, a.pool.t_claim)
    try:
        b.internals.ledger.root = a.internals.ledger.root
        for m in (a, b):
            t = m.create_block_table("t")
            for blk in m.get_new_blocks(40):            # three chunks, no tokens
                m.add_block_to_table(t, blk, 0)
            got = [[x.block_id for x in m.prepare_append(t, n)] for n in (3, 70, 1, 50, 40)]
            m.got = got
        assert a.got == b.got and calls["append"] == 5
        assert _shared_state(a) == _shared_state(b)
        a.delete_block_table("t")
        b.delete_block_table("t")
        assert _shared_state(a) == _shared_state(b) and a.check() == [] == b.check()
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_the_fused_append_takes_the_lock_itself_and_refuses_a_stale_table():
    """append() (prepare_append's common case) takes the lock itself: one hold,
    counted once; it refuses (None, nothing changed) a table record that is no
    longer the request's, a stale view, a dirty pool and a lock this thread
    holds; prepare_append then takes its Python path."""
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    try:
        p, nat = m.pool, m.pool.native
        t = m.create_block_table("t")
        ops = int(p.c[L.C_OPS])
        ids = nat.append(t.internals.table, t.internals.rid_hash, 6, 4, 0.0, p.slot, m.internals.holder.epoch)
        assert len(ids) == 2 and int(p.c[L.C_OPS]) == ops + 1 and p.c[L.C_DIRTY] == 0
        assert t.num_tokens == 6 and t.block_ids == ids
        before = bytes(p.raw)
        # (3 tokens: past the last block, so the locked path; one token into
        # the last block takes no lock at all: test_the_lock_free_append...)
        assert nat.append(t.internals.table, t.internals.rid_hash ^ 1, 3, 4, 0.0, p.slot, m.internals.holder.epoch) is None   # not its id
        assert nat.append(t.internals.table + 1, t.internals.rid_hash, 3, 4, 0.0, p.slot, m.internals.holder.epoch) is None   # no table
        assert nat.append(t.internals.table, t.internals.rid_hash, 3, 4, 0.0, p.slot, m.internals.holder.epoch + 1) is None   # stale view
        assert nat.append(t.internals.table, t.internals.rid_hash, 0, 4, 0.0, p.slot, m.internals.holder.epoch) is None       # (Python's)
        assert nat.append(t.internals.table, t.internals.rid_hash, 3, 4, 0.0, -1, m.internals.holder.epoch) is None
        assert_unchanged_but_the_lock(p, before)
        with p.lock:                            # held by this thread: not reentrant
            assert nat.append(t.internals.table, t.internals.rid_hash, 3, 4, 0.0, p.slot, m.internals.holder.epoch) is None
            assert [b.block_id for b in m.prepare_append(t, 1)] == [ids[1]]   # Python path
        m.delete_block_table("t")
        u = m.create_block_table("u")           # (reuses the record)
        assert u.internals.table == t.internals.table and nat.append(t.internals.table, t.internals.rid_hash, 1, 4, 0.0, p.slot, m.internals.holder.epoch) is None
        assert u.num_tokens == 0 and m.check() == []
    finally:
        m.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_table_ids_reads_under_the_claim_or_in_one_c_hold_and_refuses_what_python_checks():
    """table_ids() (a table's block_ids) reads under the table's claim with
    no lock (hot_claim.h), or, while the claim is busy or a pure process is
    attached, in one C hold of its own; either way it changes nothing and
    its ids are the Python path's, for a list of one chunk, of many (more
    than its stack buffer) and for an empty one. It refuses (None) a record
    no longer the request's, a lock this thread holds with the claim taken,
    and a broken chain; block_ids then takes the Python path, which raises
    for what is wrong."""
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=1024)
    try:
        p, nat = m.pool, m.pool.native
        t = m.create_block_table("t")
        assert nat.table_ids(t.internals.table, t.internals.rid_hash, p.slot, m.internals.holder.epoch) == []
        for n in (6, 4 * 300):                  # 2 blocks, then 302 (21 chunks)
            m.prepare_append(t, n)
            ops = int(p.c[L.C_OPS])
            before = bytes(p.raw)
            ids = nat.table_ids(t.internals.table, t.internals.rid_hash, p.slot, m.internals.holder.epoch)
            assert int(p.c[L.C_OPS]) == ops and bytes(p.raw) == before      # no lock
            p.c[L.C_PURE] = 1                   # (as if a pure process were attached)
            try:
                assert nat.table_ids(t.internals.table, t.internals.rid_hash, p.slot, m.internals.holder.epoch) == ids
                assert int(p.c[L.C_OPS]) == ops + 1                          # one hold
                assert nat.table_ids(t.internals.table, t.internals.rid_hash, p.slot, m.internals.holder.epoch + 1) is None  # stale view
            finally:
                p.c[L.C_PURE] = 0
            with p.lock:
                assert ids == m.internals.holder.refs.table_blocks(t.internals.table)
            assert list(t.block_ids) == ids
        assert len(ids) == 302 and len(set(ids)) == 302
        assert nat.table_ids(t.internals.table, t.internals.rid_hash ^ 1, p.slot, m.internals.holder.epoch) is None       # not its id
        assert nat.table_ids(t.internals.table + 1, t.internals.rid_hash, p.slot, m.internals.holder.epoch) is None       # no table
        assert nat.table_ids(-1, t.internals.rid_hash, p.slot, m.internals.holder.epoch) is None
        with p.lock:
            m.internals.tables.table_index(t)                   # this hold has the claim: not reentrant
            assert nat.table_ids(t.internals.table, t.internals.rid_hash, p.slot, m.internals.holder.epoch) is None
            assert list(t.block_ids) == ids     # (the Python path)
        g = m.create_block_table("gone")
        m.delete_block_table("gone")
        assert nat.table_ids(g.internals.table, g.internals.rid_hash, p.slot, m.internals.holder.epoch) is None
        with pytest.raises(KeyError):
            g.block_ids
        # a chain whose tail is not its last chunk: refused (Python reads it)
        tail = int(p.t_tail[t.internals.table])
        p.t_tail[t.internals.table] = int(p.t_head[t.internals.table])
        try:
            assert nat.table_ids(t.internals.table, t.internals.rid_hash, p.slot, m.internals.holder.epoch) is None
        finally:
            p.t_tail[t.internals.table] = tail
        # a link out of range: refused; the Python path raises
        head = int(p.t_head[t.internals.table])
        link = int(p.chunks["next"][head])
        p.chunks["next"][head] = p.layout.num_chunks + 5
        try:
            assert nat.table_ids(t.internals.table, t.internals.rid_hash, p.slot, m.internals.holder.epoch) is None
            with pytest.raises(shmcache.CorruptPoolError):
                t.block_ids
        finally:
            p.chunks["next"][head] = link
    finally:
        m.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_the_fused_acquire_counts_only_what_it_takes_and_refuses_a_stale_table():
    """acquire() (acquire_computed_blocks into a table) takes the lock itself:
    the cached run is taken into the table and counted (hits, and the miss
    that ended it) in one hold; a record no longer the request's, a stale
    view, a lock this thread holds or hashes not 16 bytes each: None, and
    nothing changes, the statistics included."""
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    try:
        p, nat = m.pool, m.pool.native
        src = m.create_block_table("src")
        tokens = list(range(12))
        m.prepare_append(src, 12)
        m.cache_full_blocks(src.block_ids, tokens, 0, 3)
        t = m.create_block_table("t")
        hs = b"".join(m.internals.ledger.hashes(tokens + [99] * 4, 4, None))       # 3 cached, then a miss
        hits, misses = int(p.c[L.C_HITS]), int(p.c[L.C_MISSES])
        before = bytes(p.raw)
        for args in ((t.internals.table, t.internals.rid_hash ^ 1, hs), (t.internals.table + 1, t.internals.rid_hash, hs), (t.internals.table, t.internals.rid_hash, hs[:-1])):
            assert nat.acquire(*args, 0.0, 4, p.slot, m.internals.holder.epoch) is None, args
        assert nat.acquire(t.internals.table, t.internals.rid_hash, hs, 0.0, 4, p.slot, m.internals.holder.epoch + 1) is None
        with p.lock:
            assert nat.acquire(t.internals.table, t.internals.rid_hash, hs, 0.0, 4, p.slot, m.internals.holder.epoch) is None
        assert_unchanged_but_the_lock(p, before)
        want = src.block_ids
        ops = int(p.c[L.C_OPS])
        got = nat.acquire(t.internals.table, t.internals.rid_hash, hs, 0.0, 4, p.slot, m.internals.holder.epoch)
        assert int(p.c[L.C_OPS]) == ops + 1 and got == want
        assert (int(p.c[L.C_HITS]), int(p.c[L.C_MISSES])) == (hits + 3, misses + 1)
        assert t.block_ids == got and t.num_tokens == 12 and p.c[L.C_DIRTY] == 0
        assert [m.blocks[b].ref_count for b in got] == [2, 2, 2]
        assert nat.acquire(t.internals.table, t.internals.rid_hash, b"", 0.0, 4, p.slot, m.internals.holder.epoch) == []   # nothing to look up
        m.delete_block_table("t")
        m.delete_block_table("src")
        assert m.check() == [] and m.free_blocks == 31
    finally:
        m.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_the_fused_lookup_and_add_block_take_the_lock_themselves_and_refuse_what_python_does():
    """lookup() (get_computed_blocks) and add_block() (add_block_to_table
    with a new reference) each run in one C hold of their own: the lookup
    counts its hits and the miss that ended it and takes no reference;
    add_block takes a free cached block out of the free list, counts the
    tokens, and says where the block went. A stale view or table, the lock
    held here, the null block, tokens over the block size, or a block with
    a reserve's mark: None, and nothing changes. A block this manager holds
    loose moves into the table (the Python path: no new reference)."""
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    try:
        p, nat = m.pool, m.pool.native
        src = m.create_block_table("src")
        tokens = list(range(12))
        m.prepare_append(src, 12)
        m.cache_full_blocks(src.block_ids, tokens, 0, 3)
        want = src.block_ids
        m.delete_block_table("src")                 # cached, free
        t = m.create_block_table("t")
        hs = b"".join(m.internals.ledger.hashes(tokens + [99] * 4, 4, None))       # 3 cached, then a miss
        loose = m.get_new_blocks(1)[0].block_id      # (allocated loose: a reserve's mark)
        hits, misses, free = int(p.c[L.C_HITS]), int(p.c[L.C_MISSES]), int(p.c[L.C_NUM_FREE])
        before = bytes(p.raw)
        assert nat.lookup(hs, -1.0, p.slot, m.internals.holder.epoch + 1) is None
        assert nat.lookup(hs[:-1], -1.0, p.slot, m.internals.holder.epoch) is None
        for args in ((t.internals.table, t.internals.rid_hash ^ 1, want[0], 4), (t.internals.table + 1, t.internals.rid_hash, want[0], 4),
                     (t.internals.table, t.internals.rid_hash, 0, 4), (t.internals.table, t.internals.rid_hash, 32, 4), (t.internals.table, t.internals.rid_hash, want[0], 5),
                     (t.internals.table, t.internals.rid_hash, want[0], -1), (t.internals.table, t.internals.rid_hash, loose, 4)):
            assert nat.add_block(*args, 4, 0.0, p.slot, m.internals.holder.epoch) is None, args
        assert nat.add_block(t.internals.table, t.internals.rid_hash, want[0], 4, 4, 0.0, p.slot, m.internals.holder.epoch + 1) is None
        with p.lock:
            assert nat.lookup(hs, -1.0, p.slot, m.internals.holder.epoch) is None
            assert nat.add_block(t.internals.table, t.internals.rid_hash, want[0], 4, 4, 0.0, p.slot, m.internals.holder.epoch) is None
        assert_unchanged_but_the_lock(p, before)
        ops = int(p.c[L.C_OPS])
        assert nat.lookup(hs, -1.0, p.slot, m.internals.holder.epoch) == want
        assert int(p.c[L.C_OPS]) == ops + 1 and p.c[L.C_DIRTY] == 0
        assert (int(p.c[L.C_HITS]), int(p.c[L.C_MISSES])) == (hits + 3, misses + 1)
        assert [m.blocks[b].ref_count for b in want] == [0, 0, 0]
        assert nat.add_block(t.internals.table, t.internals.rid_hash, want[0], 4, 4, 0.0, p.slot, m.internals.holder.epoch) == 0
        assert nat.add_block(t.internals.table, t.internals.rid_hash, want[0], 3, 4, 0.0, p.slot, m.internals.holder.epoch) == 1
        assert t.block_ids == [want[0]] * 2 and t.num_tokens == 7
        assert m.blocks[want[0]].ref_count == 2 and m.blocks[want[0]].token_count == 3
        assert int(p.c[L.C_NUM_FREE]) == free - 1 and p.c[L.C_DIRTY] == 0
        # find_cached_block: the same lookup, of one hash, touching what it finds
        h0, m0 = int(p.c[L.C_HITS]), int(p.c[L.C_MISSES])
        m.pool.blocks["last_access"][want[1]] = 0.0
        assert m.find_cached_block(tokens[:8]).block_id == want[1]
        assert m.pool.blocks["last_access"][want[1]] > 0.0
        assert m.find_cached_block([5, 5, 5, 5]) is None
        assert (int(p.c[L.C_HITS]), int(p.c[L.C_MISSES])) == (h0 + 1, m0 + 1)
        # through the manager: the seed's calls
        got, n = m.get_computed_blocks(tokens)
        assert [b.block_id for b in got] == want and n == 12
        m.add_block_to_table(t, got[1], 4)
        m.add_block_to_table(t, loose, 2)           # held loose: moved, no new reference
        assert t.block_ids == [want[0]] * 2 + [want[1], loose] and t.num_tokens == 13
        assert m.blocks[loose].ref_count == 1 and m.internals.holder.refs.loose.count(loose) == 0
        for bad in ((0, 4), (want[2], 5), (want[2], True)):
            with pytest.raises((ValueError, TypeError)):
                m.add_block_to_table(t, *bad)
        assert m.check() == []
        m.delete_block_table("t")
        assert m.check() == [] and m.free_blocks == 31
    finally:
        m.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_the_fused_new_table_takes_the_lock_itself_and_refuses_what_python_raises_for():
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32, max_tables=2)
    try:
        p, nat = m.pool, m.pool.native
        raw, h = rid_key("a")
        ops, n = int(p.c[L.C_OPS]), int(p.c[L.C_NUM_TABLES])
        t = nat.new_table(raw, h, p.slot, m.internals.holder.epoch)
        assert t is not None and int(p.c[L.C_OPS]) == ops + 1
        assert int(p.c[L.C_NUM_TABLES]) == n + 1 and p.c[L.C_DIRTY] == 0
        assert m.get_block_table("a").internals.table == t
        before = bytes(p.raw)
        assert nat.new_table(raw, h, p.slot, m.internals.holder.epoch) is None          # taken
        raw_b, h_b = rid_key("b")
        assert nat.new_table(raw_b, h_b, p.slot, m.internals.holder.epoch + 1) is None  # stale view
        assert nat.new_table(raw_b, h_b, -1, m.internals.holder.epoch) is None
        with p.lock:                                                    # held here
            assert nat.new_table(raw_b, h_b, p.slot, m.internals.holder.epoch) is None
        assert_unchanged_but_the_lock(p, before)
        m.create_block_table("b")
        assert nat.new_table(*rid_key("c"), p.slot, m.internals.holder.epoch) is None   # no table free
        with pytest.raises(shmcache.CapacityError):
            m.create_block_table("c")                                   # (the Python path says why)
        with pytest.raises(ValueError):
            m.create_block_table("a")
        m.delete_block_table("a")
        m.delete_block_table("b")
        assert m.check() == []
    finally:
        m.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_the_fused_delete_table_takes_the_lock_itself_and_refuses_what_python_raises_for():
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    try:
        p, nat = m.pool, m.pool.native
        t = m.create_block_table("a")
        m.prepare_append(t, 6)
        before = bytes(p.raw)
        assert nat.delete_table(*rid_key("zz"), p.slot, m.internals.holder.epoch) is None     # no such table
        assert nat.delete_table(*rid_key("a"), p.slot, m.internals.holder.epoch + 1) is None   # stale view
        assert nat.delete_table(*rid_key("a"), -1, m.internals.holder.epoch) is None
        with p.lock:                                                          # held here
            assert nat.delete_table(*rid_key("a"), p.slot, m.internals.holder.epoch) is None
        assert_unchanged_but_the_lock(p, before)
        ops, n = int(p.c[L.C_OPS]), int(p.c[L.C_NUM_TABLES])
        assert nat.delete_table(*rid_key("a"), p.slot, m.internals.holder.epoch) == t.internals.table
        assert int(p.c[L.C_OPS]) == ops + 1 and int(p.c[L.C_NUM_TABLES]) == n - 1
        assert p.c[L.C_DIRTY] == 0 and m.get_block_table("a") is None
        assert m.free_blocks == 31 and m.check() == []
        with pytest.raises(KeyError):
            m.delete_block_table("a")               # (the Python path says why)
    finally:
        m.close()

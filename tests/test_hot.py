"""The fused C paths (shmcache/_native/hot_loose.h: allocate/free, with
fastpath.py where it is not loaded; and hot_tables.h, hot_append.h,
hot_index.h: the table ops and prefix lookup a request's life calls, with
the Python path of tables.py and prefix.py).

Over corrupt shared state: every index they read from shared memory is
checked before use. One out of range gives up the fast path; the Python
path then raises CorruptPoolError (having rebuilt the derived state) or does
the operation, and the pool is consistent afterwards. Each case runs in a
subprocess: before, an out-of-range free-list or free-record head was a
SIGSEGV. And against the Python path: a random serving mix leaves
byte-identical metadata either way."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest

import shmcache
from shmcache import layout as L
from shmcache import lock as shlock
from shmcache.refs import rid_key

from _mutex import PythonOnly

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCENARIO = """
    import sys
    import shmcache
    from shmcache import layout as L
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32, max_refs=64)
    p = m._p
    t = m.create_block_table("t")
    for b in m.get_new_blocks(3):
        m.add_block_to_table(t, b, 4)
    m.cache_full_blocks(t.block_ids, list(range(12)), 0, 3)
    held = m.get_new_blocks(4)
    tb = list(t.block_ids)
    m.delete_block_table("t")                   # three cached free blocks at the back
    assert m.check() == []
    kind = sys.argv[1]
    # (4 loose references held: 11 more fill the first chunk, the 12th needs one)
    if kind == "free-chunk head far":
        p.c[L.C_FREE_REF] = 10**9               # the SIGSEGV of the report
        op = lambda: m.get_new_blocks(12)
    elif kind == "free-chunk head just past":
        p.c[L.C_FREE_REF] = p.layout.num_chunks
        op = lambda: m.get_new_blocks(12)
    elif kind == "free-chunk link":
        p.kw[p.c[L.C_FREE_REF] * L.CHUNK_WORDS] = -7
        op = lambda: m.get_new_blocks(27)       # two chunks
    elif kind == "free chunk in use":
        p.kw[p.c[L.C_FREE_REF] * L.CHUNK_WORDS + 1] = 5
        op = lambda: m.get_new_blocks(12)
    elif kind == "free-list head":
        p.b_next[p.HEAD] = 10**6
        op = m.allocate_block
    elif kind == "null block in free list":
        p.b_next[p.HEAD] = 0
        op = lambda: m.get_new_blocks(3)
    elif kind == "free-list link":
        p.b_next[p.b_next[p.HEAD]] = -5
        op = lambda: m.get_new_blocks(5)
    elif kind == "free-list tail":
        p.b_prev[p.TAIL] = 10**6
        m.free_block_batch(held[:1])            # uncached: to the front, fine
        p.b_flags[held[1].block_id] |= L.FLAG_CACHED
        op = lambda: m.free_block(held[1].block_id)  # cached: to the back
    elif kind == "slot list head":
        p.s_head[p.slot] = 10**6
        op = lambda: m.free_block(held[0].block_id)
    elif kind == "local word":
        m._refs.loose._top[held[0].block_id] = 10**6 + 1   # (a link is word + 1)
        op = lambda: m.free_block(held[0].block_id)
    elif kind == "slot word":
        g = m._refs.loose.top(held[0].block_id)
        p.kw[g] = held[1].block_id
        op = lambda: m.free_block(held[0].block_id)
    elif kind == "slot chunk link":
        m.free_block_batch(held[1:])            # one left
        p.kw[p.s_head[p.slot] * L.CHUNK_WORDS] = 10**6
        op = lambda: m.free_block(held[0].block_id)
    elif kind.startswith("table "):             # table_drop: table u holds tb
        u = m.create_block_table("u")
        assert m.acquire_computed_blocks(list(range(12)), table=u)[1] == 12
        hd = p.t_head[u._t]
        if kind == "table list link":
            p.kw[hd * L.CHUNK_WORDS] = 10**6
        elif kind == "table list id":
            p.kw[hd * L.CHUNK_WORDS + 2] = 10**6
        elif kind == "table ref count":
            p.b_ref[tb[0]] = 0
        elif kind == "table free-list tail":
            p.b_prev[p.TAIL] = 10**6            # the cached blocks go to the back
        op = lambda: m.delete_block_table("u")
    elif kind.startswith("acquire "):           # table_take into the empty table u
        u = m.create_block_table("u")
        if kind == "acquire free-chunk head":
            p.c[L.C_FREE_REF] = 10**9
        elif kind == "acquire free-list link":
            p.b_prev[tb[0]] = 10**6              # (the first one taken)
        elif kind == "acquire free-list prev":
            p.b_prev[tb[2]] = -1
        op = lambda: m.acquire_computed_blocks(list(range(12)), table=u)
    elif kind.startswith("append "):            # table_append into table u
        u = m.create_block_table("u")
        if kind == "append free-list head":
            p.b_next[p.HEAD] = 10**6
        elif kind == "append free-chunk head":
            p.c[L.C_FREE_REF] = 10**9
        elif kind == "append table list id":
            m.prepare_append(u, 10)             # three private blocks, the last partly filled
            p.kw[p.t_tail[u._t] * L.CHUNK_WORDS + 3] = 10**6
        op = lambda: m.prepare_append(u, 5)
    elif kind.startswith("prefix index "):      # find_chain's probes
        if kind == "prefix index entry":        # every empty slot names no block
            for i in range(len(p.hidx)):
                if p.hidx[i] < 0:
                    p.hidx[i] = 10**6
        else:                                   # no empty slot: a probe goes round
            p.hidx[:] = tb[0]
        op = lambda: m.acquire_computed_blocks(list(range(16)))
    elif kind.startswith("new table "):         # table_new's probe of the request-id index
        if kind == "new table index entry":     # every empty slot names no table
            for i in range(len(p.tidx)):
                if p.tidx[i] < 0:
                    p.tidx[i] = 10**6
        else:                                   # no empty slot: the probe goes round
            p.tidx[:] = 0
        op = lambda: m.create_block_table("v")
    else:
        raise SystemExit("unknown scenario " + kind)
    try:
        out = op()
        if isinstance(out, list):
            assert all(0 < b.block_id < 32 for b in out), [b.block_id for b in out]
        print("worked")
    except shmcache.ShmCacheError as e:
        print(type(e).__name__, e)
    except ValueError as e:
        print("ValueError", e)
    # consistent again (repaired), and usable
    assert m.check() == [], m.check()
    got = m.get_new_blocks(2)
    m.free_block_batch(got)
    assert m.check() == []
    print("consistent")
"""

KINDS = ["free-chunk head far", "free-chunk head just past", "free-chunk link",
         "free chunk in use", "free-list head", "null block in free list", "free-list link",
         "free-list tail", "slot list head", "local word", "slot word", "slot chunk link",
         "table list link", "table list id", "table ref count", "table free-list tail",
         "acquire free-chunk head", "acquire free-list link", "acquire free-list prev",
         "append free-list head", "append free-chunk head", "append table list id",
         "prefix index entry", "prefix index full", "new table index entry",
         "new table index full"]


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure"])
@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_index_never_followed(kind, pure):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("SHMCACHE_PURE", None)
    if pure:
        env["SHMCACHE_PURE"] = "1"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCENARIO), kind], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "consistent", r.stdout
    first = lines[0]
    assert first == "worked" or first.startswith(("CorruptPoolError", "ValueError")), first
    if first.startswith("CorruptPoolError"):
        assert "is corrupt" in first and "rebuilt" in first


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_alloc_checks_the_count_before_sizing_anything():
    """_hot.alloc sized its buffers by n before looking at it: 2**40 was a
    MemoryError. Now a count the pool cannot have goes to the slow path."""
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    try:
        p = m._p
        assert p.native.alloc(2**40, p.slot, m._epoch, m._refs.loose.buf) is None
        assert p.native.alloc(32, p.slot, m._epoch, m._refs.loose.buf) is None
        assert len(p.native.alloc(31, p.slot, m._epoch, m._refs.loose.buf)) == 31
        with pytest.raises(ValueError):
            p.native.set_chunks(10**12, 36, 15)  # more chunks than the mapping holds
        assert m.check() == []
    finally:
        m.close()


# ------------------------------------------- the table ops: C against Python

def _shared_state(m):
    """The segment's metadata the table ops touch, minus what differs between
    two pools by construction (seeds, times, lock bookkeeping)."""
    p = m._p
    b = p.blocks
    c = p.counters.copy()
    c[[L.C_OPS, L.C_LOCK_WAIT_NS, L.C_DIRTY, L.C_HOLDER]] = 0
    return (b["ref_count"].tobytes(), b["prev"].tobytes(), b["next"].tobytes(),
            b["flags"].tobytes(), b["token_count"].tobytes(), b["gen"].tobytes(),
            b["hash"].tobytes(), p.chunks.tobytes(), p.slots["loose_head"].tobytes(),
            p.slots["loose_count"].tobytes(), c.tobytes(), p.tables.tobytes(),
            p.tidx.tobytes(), p.hidx.tobytes(), m._refs.loose.buf.tobytes())


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
                t = m.create_block_table(rid)
                tokens = rng.choice(prompts)[:bs * rng.randint(0, 6)]
                tokens = tokens + [rng.randrange(50) for _ in range(rng.randrange(2 * bs))]
                got, n = m.acquire_computed_blocks(tokens, table=t)
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
    b._p.native = b._p.lock.native = PythonOnly(b._p.native)
    calls = {"table_new": 0, "table_drop": 0, "table_take": 0, "table_append": 0,
             "find_chain": 0}
    a._p.native = a._p.lock.native = _Counted(a._p.native, calls)
    try:
        b._root = a._root                        # same chain hashes in both
        for seed in range(6):
            la, lb = _serve(a, seed), _serve(b, seed)
            assert la == lb
            assert _shared_state(a) == _shared_state(b)
            assert a.check() == [] and b.check() == []
        assert calls["table_drop"] > 50 and calls["table_take"] > 20, calls
        assert calls["table_append"] > 50 and calls["find_chain"] > 50, calls
        assert calls["table_new"] > 50, calls
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
        p, nat = m._p, m._p.native
        t = m.create_block_table("t")
        m.prepare_append(t, 6)
        before = bytes(p.raw)
        assert nat.table_drop(t._t) is None                  # lock not held
        assert nat.table_append(t._t, 1, 4, 0.0) is None
        assert nat.table_take(t._t, [5], 0.0, 4) is None
        assert nat.table_new(b"u", 7, p.slot) is None
        with p.lock:
            raw, h = rid_key("t")
            assert nat.table_new(raw, h, p.slot) is None     # taken
            assert nat.table_new(b"", 7, p.slot) is None
            assert nat.table_new(b"a\x00b", 7, p.slot) is None
            assert nat.table_drop(t._t + 1) is None          # not a live table
            assert nat.table_drop(-1) is None and nat.table_drop(10**6) is None
            assert nat.table_append(t._t, 0, 4, 0.0) is None     # (the Python path's)
            for bad in ([0], [32], [True], ["1"], [10**20]):
                assert nat.table_take(t._t, bad, 0.0, 4) is None, bad
            assert nat.find_chain([b"short"]) is None
            assert nat.find_chain([]) == []
        after = bytearray(p.raw)
        # (the lock word and the hold's bookkeeping differ; the pool does not)
        lo, hi = L.MUTEX_OFF, L.HEADER_SIZE
        co = p.layout.counters_off
        for a, b in ((lo, hi), (co + 8 * L.C_OPS, co + 8 * L.C_OPS + 8)):
            after[a:b] = before[a:b]
        assert bytes(after) == before
        m.delete_block_table("t")
        assert m.check() == [] and m.free_blocks == 31
    finally:
        m.close()


@pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")
def test_c_append_into_blocks_before_the_tail_chunk_matches_python():
    """Tokens landing in chunks before the tail's (a table holding more
    blocks than its tokens fill): table_append walks the chain."""
    a = shmcache.PagedCacheManager(block_size=4, max_blocks=64)
    b = shmcache.PagedCacheManager(block_size=4, max_blocks=64)
    b._p.native = b._p.lock.native = PythonOnly(b._p.native)
    calls = {"table_append": 0}
    a._p.native = a._p.lock.native = _Counted(a._p.native, calls)
    try:
        b._root = a._root
        for m in (a, b):
            t = m.create_block_table("t")
            for blk in m.get_new_blocks(40):            # three chunks, no tokens
                m.add_block_to_table(t, blk, 0)
            got = [[x.block_id for x in m.prepare_append(t, n)] for n in (3, 70, 1, 50, 40)]
            m.got = got
        assert a.got == b.got and calls["table_append"] == 5
        assert _shared_state(a) == _shared_state(b)
        a.delete_block_table("t")
        b.delete_block_table("t")
        assert _shared_state(a) == _shared_state(b) and a.check() == [] == b.check()
    finally:
        a.close()
        b.close()

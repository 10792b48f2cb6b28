"""The fused C paths of shmcache._hot (shmcache/_native/hot_loose.h:
allocate/free, with fastpath.py where it is not loaded).

Over corrupt shared state: every index they read from shared memory is
checked before use. One out of range gives up the fast path; the Python
path then raises CorruptPoolError (having rebuilt the derived state) or does
the operation, and the pool is consistent afterwards. Each case runs in a
subprocess: before, an out-of-range free-list or free-record head was a
SIGSEGV. (The table ops against their Python paths: test_hot_tables.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import shmcache
from shmcache.shm import lock as shlock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCENARIO = """
    import sys
    import shmcache
    from shmcache.shm import layout as L
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32, max_refs=64)
    p = m.pool
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
        m.internals.holder.refs.loose._top[held[0].block_id] = 10**6 + 1   # (a link is word + 1)
        op = lambda: m.free_block(held[0].block_id)
    elif kind == "slot word":
        g = m.internals.holder.refs.loose.top(held[0].block_id)
        p.kw[g] = held[1].block_id
        op = lambda: m.free_block(held[0].block_id)
    elif kind == "slot chunk link":
        m.free_block_batch(held[1:])            # one left
        p.kw[p.s_head[p.slot] * L.CHUNK_WORDS] = 10**6
        op = lambda: m.free_block(held[0].block_id)
    elif kind.startswith("table "):             # table_drop: table u holds tb
        u = m.create_block_table("u")
        assert m.acquire_computed_blocks(list(range(12)), table=u)[1] == 12
        hd = p.t_head[u.internals.table]
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
            p.kw[p.t_tail[u.internals.table] * L.CHUNK_WORDS + 3] = 10**6
        op = lambda: m.prepare_append(u, 5)
    elif kind.startswith("prefix index "):      # find_chain's probes
        if kind == "prefix index entry":        # every empty slot names no block
            for i in range(len(p.hidx)):
                if p.hidx[i] < 0:
                    p.hidx[i] = 10**6
        else:                                   # no empty slot: a probe goes round
            p.hidx[:] = tb[0]
        op = lambda: m.acquire_computed_blocks(list(range(16)))
    elif kind.startswith("evict "):             # allocations that evict tb, cached and free
        for i in range(len(p.hidx)):            # every empty slot names no block
            if p.hidx[i] < 0:
                p.hidx[i] = 10**6
        if kind == "evict alloc index entry":
            op = lambda: m.get_new_blocks(26)   # the 24 uncached free blocks, then tb
        else:
            u = m.create_block_table("u")
            op = lambda: m.prepare_append(u, 26 * 4)
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
         "prefix index entry", "prefix index full", "evict alloc index entry",
         "evict append index entry", "new table index entry",
         "new table index full"]


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure"])
@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_index_never_followed(kind, pure):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
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
        p = m.pool
        assert p.native.alloc(2**40, p.slot, m.internals.holder.epoch, m.internals.holder.refs.loose.buf) is None
        assert p.native.alloc(32, p.slot, m.internals.holder.epoch, m.internals.holder.refs.loose.buf) is None
        assert len(p.native.alloc(31, p.slot, m.internals.holder.epoch, m.internals.holder.refs.loose.buf)) == 31
        with pytest.raises(ValueError):
            p.native.set_chunks(10**12)  # more chunks than the mapping holds
        assert m.check() == []
    finally:
        m.close()


@pytest.mark.parametrize("pure", [False, True], ids=["native", "SHMCACHE_PURE"])
def test_the_hot_operations_are_chosen_once_at_attach(pure):
    """pool.ops is the C accelerator's (NativeOps) where _hot is built, and
    the Python reference (ReferenceOps) with SHMCACHE_PURE=1, whose fused
    operations all answer None (the callers' Python paths run)."""
    if not pure and not shlock.ACCELERATED:
        pytest.skip("the C accelerator is not built")
    code = textwrap.dedent("""
        import shmcache
        from shmcache.shm import hot_ops
        m = shmcache.PagedCacheManager(block_size=4, max_blocks=16)
        ops = m.pool.ops
        print(type(ops).__name__, ops.native)
        if not ops.native:
            assert not any(n in vars(ops) for n in hot_ops.OPERATIONS)   # the class's own
            assert ops.alloc(1, m.pool.slot, 0, None) is None
        else:
            assert ops.hot is m.pool.native       # each op the compiled object's method
            assert all(n in vars(ops) for n in hot_ops.OPERATIONS)
        ids = [b.block_id for b in m.get_new_blocks(3)]
        m.free_block_batch(ids)
        assert m.free_blocks == 15 and m.check() == []
        m.close()
    """)
    env = dict(os.environ)
    env.pop("SHMCACHE_PURE", None)
    if pure:
        env["SHMCACHE_PURE"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == (["ReferenceOps", "False"] if pure else ["NativeOps", "True"])

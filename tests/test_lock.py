"""The pool lock: a failed repair never keeps the lock."""

from __future__ import annotations

import os

import pytest

import shmcache
from shmcache import layout as L
from shmcache import segment

from _proc_client import lock_is_busy


def test_a_repair_that_raises_releases_the_lock_and_leaves_the_pool_dirty(make_pool, monkeypatch):
    from shmcache import recovery
    owner = make_pool()
    other = shmcache.attach(owner.name)
    try:
        owner._p.c[L.C_DIRTY] = 1           # as if a holder died mid-update
        real = recovery.repair

        def broken(p):
            if p is other._p:
                raise RuntimeError("repair failed")
            real(p)
        monkeypatch.setattr(recovery, "repair", broken)
        with pytest.raises(RuntimeError, match="repair failed"):
            other.allocate_block()
        assert other._p.c[L.C_DIRTY] == 1  # the next holder must repair
        assert not lock_is_busy(segment.path_for(owner.name))   # nobody holds it now
        assert owner.allocate_block() is not None   # owner repairs and goes on
        assert owner._p.c[L.C_DIRTY] == 0 and owner.check() == []
        assert owner._p.c[L.C_RECOVERIES] >= 1
    finally:
        other.close()


@pytest.mark.timeout(60)
def test_threads_of_one_process_share_a_manager(make_pool):
    import random
    import threading
    mgr = make_pool(max_blocks=64)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for i in range(300):
                bs = mgr.get_new_blocks(rng.randint(1, 3))
                t = mgr.create_block_table(f"t{seed}-{i}")
                for b in bs:
                    mgr.add_block_to_table(t, b, 4)
                toks = [rng.randrange(8) for _ in range(4 * len(bs))]
                mgr.cache_full_blocks(t.block_ids, toks, 0, len(bs))
                got, n = mgr.acquire_computed_blocks(toks)
                mgr.free_block_batch(got)
                mgr.prepare_append(mgr.fork_block_table(t, f"f{seed}-{i}"), 1)
                mgr.delete_block_table(f"f{seed}-{i}")
                mgr.delete_block_table(t.request_id)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    import sys
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)      # switch threads often, inside operations too
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert mgr.check() == []
    assert mgr.free_blocks == mgr.max_blocks - 1 and len(mgr.request_tables) == 0

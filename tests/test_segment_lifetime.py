"""The lifetime of pool segments in /dev/shm: a private pool leaves nothing
there, a named one stays until it is destroyed, and it outlives the
processes that attach to it, however they exit."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import shmcache
from shmcache.shm import segment
from shmcache.errors import PoolExistsError, PoolNotFoundError

from _shm import private_names, shm_path


def run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ private pools
def test_private_manager_leaves_nothing_in_dev_shm():
    before = private_names()
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=16)
    try:
        b = m.allocate_block()
        assert b is not None
        assert private_names() == before          # even while open
        assert not os.path.exists(shm_path(m.name))
    finally:
        m.close()
    assert private_names() == before


def test_private_manager_is_released_when_collected():
    import weakref
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=16)
    p = m.pool
    m.allocate_block()
    w = weakref.ref(m)
    del m
    gc.collect()
    assert w() is None          # nothing in the pool keeps its manager alive
    assert p.closed


def test_attached_manager_is_released_when_collected(make_pool):
    m = make_pool()
    other = shmcache.attach(m.name)
    other.get_new_blocks(2)
    t = other.create_block_table("r")
    other.add_block_to_table(t, other.allocate_block(), 1)
    assert m.free_blocks == 28
    del other, t
    gc.collect()
    assert m.free_blocks == 31
    assert len(m.request_tables) == 0
    assert m.check() == []


def test_private_manager_context_manager():
    with shmcache.PagedCacheManager(block_size=4, max_blocks=16) as m:
        m.allocate_block()
        p = m.pool
    assert p.closed


# ------------------------------------------------------------------ named pools
def test_create_twice_raises_and_keeps_the_first(make_pool):
    m = make_pool()
    m.allocate_block()
    with pytest.raises(PoolExistsError):
        shmcache.create_pool(m.name, block_size=4, max_blocks=32)
    assert m.free_blocks == 30 and m.check() == []
    assert os.path.exists(shm_path(m.name))


def test_context_manager_destroys_the_pool(pool_name):
    with shmcache.create_pool(pool_name, block_size=4, max_blocks=8) as m:
        assert os.path.exists(shm_path(pool_name))
        m.allocate_block()
    assert not os.path.exists(shm_path(pool_name))
    with pytest.raises(PoolNotFoundError):
        shmcache.attach(pool_name)


def test_attached_manager_context_exit_does_not_destroy(make_pool):
    m = make_pool()
    with shmcache.attach(m.name) as other:
        other.allocate_block()
    assert os.path.exists(shm_path(m.name))
    assert m.free_blocks == 31 and m.check() == []    # its block was released


def test_creator_close_keeps_pool_destroy_unlinks(pool_name):
    m = shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    m.close()
    assert os.path.exists(shm_path(pool_name))
    m2 = shmcache.attach(pool_name)
    assert m2.check() == []
    m2.close()
    assert shmcache.destroy(pool_name) is True
    assert shmcache.destroy(pool_name) is False
    assert not os.path.exists(shm_path(pool_name))


def test_destroy_by_creator(pool_name):
    m = shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    m.destroy()
    assert pool_name not in segment.list_names()


def test_list_names_sees_named_pools(make_pool):
    m = make_pool()
    assert m.name in segment.list_names()
    assert segment.path_for(m.name) == shm_path(m.name)


# ------------------------------------------------------------------ other processes
def test_pool_survives_an_attached_process_that_exits(make_pool):
    m = make_pool()
    r = run_py(f"""
        import shmcache
        m = shmcache.attach({m.name!r})
        t = m.create_block_table("child")
        m.add_block_to_table(t, m.allocate_block(), 4)
        m.allocate_block()
        m.close()
        m2 = shmcache.attach({m.name!r})
        m2.allocate_block()
        # exit without closing m2
    """)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(shm_path(m.name))
    m.reclaim_dead()   # the unclosed manager's block: released at its exit or now
    assert m.free_blocks == 31
    assert m.check() == []
    other = shmcache.attach(m.name)     # still attachable
    assert other.check() == []
    other.close()


def test_pool_survives_a_process_using_multiprocessing_then_exiting(make_pool):
    # a child that also touches multiprocessing (and its resource tracker)
    m = make_pool()
    r = run_py(f"""
        import multiprocessing.resource_tracker, shmcache
        m = shmcache.attach({m.name!r})
        m.get_new_blocks(2)
        m.close()
    """)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(shm_path(m.name))
    assert m.free_blocks == 31


def test_pool_survives_a_killed_attached_process(make_pool):
    m = make_pool()
    r = run_py(f"""
        import os, signal, shmcache
        m = shmcache.attach({m.name!r})
        m.get_new_blocks(3)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert r.returncode == -signal.SIGKILL
    assert os.path.exists(shm_path(m.name))
    assert m.free_blocks == 28
    assert m.reclaim_dead() == 3
    assert m.free_blocks == 31 and m.check() == []


def test_private_pool_not_visible_to_other_processes():
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=8)
    try:
        r = run_py(f"""
            import shmcache
            try:
                shmcache.attach({m.name!r})
            except shmcache.PoolNotFoundError:
                print("notfound")
        """)
        assert r.stdout.strip() == "notfound", r.stderr
    finally:
        m.close()

"""Shared fixtures: unique pool names per test, and /dev/shm left clean.

Every named pool a test creates is named ``test-<run>-...``; the session
finaliser unlinks whatever of this run is left, even after failures, and
``make test`` then fails loudly if a segment is left (see
``test_zz_no_segments_left``).
"""

from __future__ import annotations

import itertools
import os

import pytest

import shmcache
from shmcache.shm import segment

RUN = f"test-{os.getpid()}"
_counter = itertools.count()


def new_name(tag: str = "p") -> str:
    return f"{RUN}-{tag}-{next(_counter)}"


def leftover_segments() -> list:
    return [n for n in segment.list_names() if n.startswith(RUN)]


@pytest.fixture
def pool_name():
    name = new_name()
    yield name
    segment.unlink(name)


@pytest.fixture
def make_pool():
    """Factory: make_pool(**kw) -> creator manager of a fresh named pool."""
    made = []

    def factory(**kw):
        name = kw.pop("name", None) or new_name()
        kw.setdefault("block_size", 4)
        kw.setdefault("max_blocks", 32)
        m = shmcache.create_pool(name, **kw)
        made.append(m)
        return m

    yield factory
    for m in made:
        try:
            m.destroy()
        except Exception:
            segment.unlink(m.name)


@pytest.fixture
def manager():
    """A private manager (the seed's constructor), block_size 4, 32 blocks."""
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    yield m
    m.close()


@pytest.fixture
def spawn():
    """spawn(*args, env=None) -> a started ``_proc_client.WorkerProc``; all are killed at teardown."""
    from _proc_client import WorkerProc
    procs = []

    def start(*args, **kw):
        w = WorkerProc(*args, **kw)
        procs.append(w)
        return w

    yield start
    for w in procs:
        try:
            w.kill()
        except Exception:
            pass


def pytest_sessionfinish(session, exitstatus):
    for n in leftover_segments():
        segment.unlink(n)

"""The pool lock: a failed repair never keeps the lock."""

from __future__ import annotations

import fcntl
import os

import pytest

import shmcache
from shmcache import layout as L
from shmcache import segment


def test_a_repair_that_raises_releases_the_lock_and_leaves_the_pool_dirty(make_pool):
    owner = make_pool()
    other = shmcache.attach(owner.name)
    try:
        owner._p.c[L.C_DIRTY] = 1           # as if a holder died mid-update

        def broken():
            raise RuntimeError("repair failed")
        other._p.on_dirty = broken
        with pytest.raises(RuntimeError, match="repair failed"):
            other.allocate_block()
        assert other._p.c[L.C_DIRTY] == 1  # the next holder must repair
        fd = os.open(segment.path_for(owner.name), os.O_RDWR)
        try:                                # nobody holds the pool lock now
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        assert owner.allocate_block() is not None   # owner repairs and goes on
        assert owner._p.c[L.C_DIRTY] == 0 and owner.check() == []
        assert owner._p.c[L.C_RECOVERIES] >= 1
    finally:
        other.close()

"""Creating a pool segment: attaching while the creator is still
initialising it (or died doing so), a failed creation, the header checksum,
and creation without O_TMPFILE or /proc."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import segment
from shmcache.errors import PoolExistsError

from _shm import private_names, shm_path


# ------------------------------------------------------------------ creation
SLOW_CREATOR = """
    import sys, time
    import shmcache
    from shmcache.pool.pool import Pool
    delay = float(sys.argv[2])
    init = Pool._initialise
    def slow(self):
        print("creating", flush=True)
        time.sleep(delay)
        init(self)
    Pool._initialise = slow
    m = shmcache.create_pool(sys.argv[1], block_size=4, max_blocks=16)
    m.allocate_block()
    print("created", flush=True)
    time.sleep(60)
"""


def _slow_creator(name: str, delay: float) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SLOW_CREATOR), name, str(delay)],
                         env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "creating"
    assert os.path.exists(shm_path(name))           # named while it is being initialised
    return p


def test_attach_during_creation_waits_for_the_creator(pool_name):
    p = _slow_creator(pool_name, 1.5)
    try:
        t0 = time.monotonic()
        m = shmcache.attach(pool_name, timeout=30)  # used to fail at once: "bad magic"
        waited = time.monotonic() - t0
        try:
            assert waited > 0.5
            assert m.check() == [] and m.free_blocks == 14   # the creator's block is held
        finally:
            m.close()
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_attach_during_creation_gives_up_after_its_timeout(pool_name):
    from shmcache.errors import IncompatiblePoolError
    p = _slow_creator(pool_name, 30)
    try:
        t0 = time.monotonic()
        with pytest.raises(IncompatiblePoolError, match="still being created"):
            shmcache.attach(pool_name, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 10
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_attach_after_the_creator_died_creating_fails_at_once(pool_name):
    from shmcache.errors import IncompatiblePoolError
    from shmcache.pool.inspect_pool import cleanup
    p = _slow_creator(pool_name, 60)
    p.kill()
    p.wait()
    p.stdout.close()
    t0 = time.monotonic()
    with pytest.raises(IncompatiblePoolError) as ei:
        shmcache.attach(pool_name, timeout=30)
    assert time.monotonic() - t0 < 5                # not the 30 s timeout
    assert "never initialised" in str(ei.value) and str(p.pid) in str(ei.value)
    ok, why = cleanup(pool_name)                    # and `shmcache cleanup` removes it
    assert ok, why
    assert not os.path.exists(shm_path(pool_name))
    m = shmcache.create_pool(pool_name, block_size=4, max_blocks=8)   # the name is free again
    m.destroy()


def test_a_failed_creation_leaves_no_half_made_file(pool_name, monkeypatch):
    from shmcache.pool.pool import Pool

    def boom(self):
        raise RuntimeError("initialisation failed")
    monkeypatch.setattr(Pool, "_initialise", boom)
    with pytest.raises(RuntimeError):
        shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    assert not os.path.exists(shm_path(pool_name))


def test_header_is_checksummed(make_pool):
    m = make_pool()
    h = m.pool.header[0]
    assert bytes(h["checksum"]) == L.header_checksum(h) != bytes(16)


@pytest.mark.parametrize("how", ["no O_TMPFILE", "no /proc link"])
def test_creation_without_o_tmpfile_or_proc(pool_name, monkeypatch, how):
    """Where the file cannot be made nameless (or named through /proc), it is
    made under its name with O_EXCL and locked at once: same pool, same mode."""
    import errno
    if how == "no O_TMPFILE":
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    else:
        def no_proc(fd, path):
            raise OSError(errno.ENOENT, "No such file or directory")
        monkeypatch.setattr(segment, "link_fd", no_proc)
    m = shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    try:
        assert stat.S_IMODE(os.stat(shm_path(pool_name)).st_mode) == 0o600
        other = shmcache.attach(pool_name)
        other.allocate_block()
        assert other.check() == [] and m.free_blocks == 6
        other.close()
        with pytest.raises(PoolExistsError):
            shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    finally:
        m.destroy()
    before = private_names()
    p = shmcache.PagedCacheManager(block_size=4, max_blocks=8)
    assert private_names() == before
    p.close()

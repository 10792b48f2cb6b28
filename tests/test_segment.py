"""Pool segments in /dev/shm (``shmcache.shm.segment``): permissions, sizing,
names, and segments another user planted or can write.

Their lifetime is in ``test_segment_lifetime.py``, their creation (and
attaching while one is being created) in ``test_segment_creation.py``.
"""

from __future__ import annotations

import os
import stat

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import segment
from shmcache.errors import InsufficientSharedMemoryError, PoolExistsError, PoolNotFoundError

from conftest import new_name
from _shm import private_names, shm_path


def shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------------ permissions
def test_segment_mode_is_0600(make_pool):
    m = make_pool()
    st = os.stat(shm_path(m.name))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()


def test_segment_mode_is_0600_even_with_open_umask(make_pool):
    old = os.umask(0)
    try:
        m = make_pool()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(shm_path(m.name)).st_mode) == 0o600


def test_segment_size_is_the_layout_size_and_reserved(make_pool):
    m = make_pool(block_size=4, max_blocks=32, num_layers=2, head_dim=16)
    st = os.stat(shm_path(m.name))
    assert st.st_size == m.layout.total_size
    # reserved up front (posix_fallocate), not a sparse file
    assert st.st_blocks * 512 >= m.layout.total_size


# ------------------------------------------------------------------ sizing
def _too_big_params():
    free = shm_free()
    kw = dict(block_size=64, max_blocks=1000, num_layers=64, num_kv_heads=8, head_dim=128,
              dtype="float32")
    while True:
        lay = L.compute_layout(kw["block_size"], kw["max_blocks"], True, kw["num_layers"],
                               kw["num_kv_heads"], kw["head_dim"], kw["dtype"], 64,
                               min(max(64, kw["max_blocks"]), 4096),
                               L.default_max_refs(kw["max_blocks"], min(max(64, kw["max_blocks"]), 4096)))
        if lay.total_size > 2 * free:
            return kw, lay.total_size
        kw["num_layers"] *= 4


def test_pool_bigger_than_dev_shm_fails_with_sizes(pool_name):
    kw, size = _too_big_params()
    with pytest.raises(InsufficientSharedMemoryError) as ei:
        shmcache.create_pool(pool_name, **kw)
    msg = str(ei.value)
    assert f"{size:,}" in msg                 # the size asked for
    assert "/dev/shm" in msg and "free" in msg
    assert pool_name not in segment.list_names()
    assert isinstance(ei.value, MemoryError)


def test_private_pool_bigger_than_dev_shm_fails(monkeypatch):
    kw, size = _too_big_params()
    before = private_names()
    with pytest.raises(InsufficientSharedMemoryError):
        shmcache.PagedCacheManager(kw.pop("block_size"), kw.pop("max_blocks"), **kw)
    assert private_names() == before


def test_reservation_failure_is_a_clear_error_and_leaves_nothing(pool_name, monkeypatch):
    import errno

    def no_space(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(InsufficientSharedMemoryError) as ei:
        shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    assert "bytes" in str(ei.value)
    assert pool_name not in segment.list_names()


# ------------------------------------------------------------------ names
@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "../x", "with space", "x" * 201,
                                 "tab\tname", "nul\x00", "é", 5, None, b"bytes"])
def test_bad_names_rejected(bad):
    with pytest.raises(ValueError):
        segment.check_name(bad)
    with pytest.raises(ValueError):
        shmcache.create_pool(bad, block_size=4, max_blocks=8)
    with pytest.raises(ValueError):
        shmcache.attach(bad)


@pytest.mark.parametrize("tag", ["a", "A_b-c.d", "x" * 150])
def test_good_names_accepted(tag):
    name = new_name(tag)[:200]
    assert segment.check_name(name) == name
    m = shmcache.create_pool(name, block_size=4, max_blocks=8)
    try:
        assert os.path.exists(shm_path(name))
    finally:
        m.destroy()


def test_attach_nonexistent_raises_pool_not_found(pool_name):
    with pytest.raises(PoolNotFoundError) as ei:
        shmcache.attach(pool_name)
    assert pool_name in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)
    assert pool_name not in segment.list_names()


# ------------------------------------------------------------------ ownership
OTHER_UID = 54321           # a uid with no account here: "another local user"


def _planted(name: str, mode: int, uid: int = OTHER_UID) -> str:
    """The file another user could make first: /dev/shm/shmcache.<name>, of
    ``uid``, with ``mode``, holding a copy of a real pool (so only its
    owner or mode can be wrong)."""
    src = shmcache.create_pool(name + "-src", block_size=4, max_blocks=8)
    try:
        with open(shm_path(src.name), "rb") as f:
            data = f.read()
    finally:
        src.destroy()
    path = shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
        os.fchown(fd, uid, -1)
    finally:
        os.close(fd)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid needs root")
def test_planted_segment_of_another_user_is_refused(pool_name):
    from shmcache.errors import UnsafePoolError
    path = _planted(pool_name, 0o666)
    with open(path, "rb") as f:
        before = f.read()
    with pytest.raises(PoolExistsError):
        shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    with pytest.raises(UnsafePoolError) as ei:
        shmcache.attach(pool_name)
    assert f"uid {OTHER_UID}" in str(ei.value) and path in str(ei.value)
    assert isinstance(ei.value, shmcache.ShmCacheError) and isinstance(ei.value, PermissionError)
    with open(path, "rb") as f:
        assert f.read() == before                   # not touched


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid needs root")
def test_segment_of_another_user_is_refused_even_0600(pool_name):
    from shmcache.errors import UnsafePoolError
    _planted(pool_name, 0o600)
    with pytest.raises(UnsafePoolError, match=f"uid {OTHER_UID}"):
        shmcache.attach(pool_name)


@pytest.mark.parametrize("mode,who", [(0o666, "group and others"), (0o602, "others"),
                                      (0o620, "group")])
def test_segment_writable_by_others_is_refused(make_pool, mode, who):
    from shmcache.errors import UnsafePoolError
    m = make_pool()
    os.chmod(shm_path(m.name), mode)
    with pytest.raises(UnsafePoolError) as ei:
        shmcache.attach(m.name)
    assert f"writable by {who}" in str(ei.value) and f"{mode:04o}" in str(ei.value)
    os.chmod(shm_path(m.name), 0o644)               # readable, not writable, by others: fine
    other = shmcache.attach(m.name)
    assert other.check() == []
    other.close()


def test_the_check_is_on_the_open_file_not_the_path(make_pool, monkeypatch):
    """os.fstat of the descriptor attach opened: a file swapped in after the
    open, or a path that looks fine, changes nothing."""
    from shmcache.errors import UnsafePoolError
    m = make_pool()
    os.chmod(shm_path(m.name), 0o666)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda *a, **k: real_stat(__file__))  # the path "looks" fine
    with pytest.raises(UnsafePoolError):
        shmcache.attach(m.name)


def test_symlink_is_refused(make_pool, pool_name):
    from shmcache.errors import UnsafePoolError
    m = make_pool()
    os.symlink(shm_path(m.name), shm_path(pool_name))
    try:
        with pytest.raises(UnsafePoolError, match="symbolic link"):
            shmcache.attach(pool_name)
    finally:
        os.unlink(shm_path(pool_name))

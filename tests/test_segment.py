"""Pool segments in /dev/shm: permissions, sizing, names, lifetime."""

from __future__ import annotations

import gc
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

import shmcache
from shmcache import layout as L
from shmcache import segment
from shmcache.errors import InsufficientSharedMemoryError, PoolExistsError, PoolNotFoundError

from conftest import new_name


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", "shmcache." + name)


def private_names() -> list:
    return [n for n in segment.list_names() if n.startswith(f"private-{os.getpid()}-")]


def shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


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
    p = m._p
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
        p = m._p
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


# ------------------------------------------------------------------ creation
SLOW_CREATOR = """
    import sys, time
    import shmcache
    from shmcache.pool import Pool
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
    from shmcache.inspect_pool import cleanup
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
    from shmcache.pool import Pool

    def boom(self):
        raise RuntimeError("initialisation failed")
    monkeypatch.setattr(Pool, "_initialise", boom)
    with pytest.raises(RuntimeError):
        shmcache.create_pool(pool_name, block_size=4, max_blocks=8)
    assert not os.path.exists(shm_path(pool_name))


def test_header_is_checksummed(make_pool):
    m = make_pool()
    h = m._p.header[0]
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

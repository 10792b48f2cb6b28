"""``shmcache cleanup``: a pool is removed only when its owner is dead and
no live process is attached; patterns; what is not a pool is skipped.

Every command runs as a real subprocess (``tests/_cli.py``).
"""

from __future__ import annotations

import os
import signal

from shmcache.shm import segment

from conftest import RUN, new_name
from _cli import assert_error, run, write_segment
from _cli import holders, junk_name  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["holders", "junk_name"]


# ----------------------------------------------------------------- cleanup
def test_cleanup_after_owner_sigkilled(holders):
    name = new_name("cl")
    h = holders(name, n=2)
    assert run("cleanup", name).returncode == 1          # owner alive: kept
    assert os.path.exists(segment.path_for(name))
    h.p.send_signal(signal.SIGKILL)
    h.p.wait()
    r = run("cleanup", name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"removed {segment.path_for(name)}" in r.stdout and "dead" in r.stdout
    assert not os.path.exists(segment.path_for(name))
    assert_error(run("cleanup", name), "no shmcache pool named")


def test_cleanup_never_removes_live_pool(make_pool):
    m = make_pool()
    r = run("cleanup", m.name)
    assert r.returncode == 1
    assert f"kept {m.name}: owner pid {os.getpid()} is alive" in r.stdout
    assert os.path.exists(segment.path_for(m.name))
    assert m.check() == [] and m.allocate_block() is not None


def test_cleanup_keeps_pool_with_live_attached_process(holders):
    name = new_name("cl")
    owner = holders(name)
    worker = holders(name, mode="attach", n=1)
    owner.kill()
    r = run("cleanup", name)
    assert r.returncode == 1 and "live process(es) attached" in r.stdout
    assert str(worker.p.pid) in r.stdout
    assert os.path.exists(segment.path_for(name))
    worker.kill()
    r = run("cleanup", name)
    assert r.returncode == 0 and "removed" in r.stdout
    assert not os.path.exists(segment.path_for(name))


def test_cleanup_pattern_removes_only_dead(make_pool, holders, junk_name):
    tag = f"{RUN}-glob{os.getpid()}"
    dead = [f"{tag}-{i}" for i in range(2)]
    for n in dead:
        holders(n, n=1).kill()
    live = make_pool(name=f"{tag}-live")
    write_segment(f"{tag}-junk", b"junk")
    try:
        r = run("cleanup", f"{tag}-*")
        assert r.returncode == 0, r.stdout + r.stderr
        for n in dead:
            assert f"removed {segment.path_for(n)}" in r.stdout
            assert not os.path.exists(segment.path_for(n))
        assert f"kept {live.name}" in r.stdout and os.path.exists(segment.path_for(live.name))
        assert f"skipped {tag}-junk: " in r.stdout and os.path.exists(segment.path_for(f"{tag}-junk"))
        r = run("cleanup", f"{tag}-*")
        assert "nothing removed" in r.stdout
    finally:
        segment.unlink(f"{tag}-junk")


def test_cleanup_treats_a_zombie_owner_as_dead(holders):
    """The owner was killed but its parent (this test) has not reaped it:
    a zombie runs nothing and holds nothing, so the pool is removed."""
    import psutil
    name = new_name("cl")
    h = holders(name, n=2)
    os.kill(h.p.pid, signal.SIGKILL)
    for _ in range(100):
        if psutil.Process(h.p.pid).status() == psutil.STATUS_ZOMBIE:
            break
        import time
        time.sleep(0.05)
    assert psutil.Process(h.p.pid).status() == psutil.STATUS_ZOMBIE
    try:
        r = run("cleanup", name)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"removed {segment.path_for(name)}" in r.stdout
        assert not os.path.exists(segment.path_for(name))
    finally:
        h.kill()                                   # reaps it
        segment.unlink(name)

"""Running the ``shmcache`` command in the tests of it (``test_cli``,
``test_cli_errors``, ``test_cli_fsck``, ``test_cli_cleanup``).

Every command runs as a real subprocess (the installed console script), so
exit codes, stdout/stderr and "no traceback" are what an operator sees.
Pools owned by other processes are made by small helper scripts that print
``ready`` and then wait to be killed (the ``holders`` fixture). The fixtures
are imported by name into the test modules that use them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shmcache.shm import segment

from conftest import new_name


BIN = os.path.join(os.path.dirname(sys.executable), "shmcache")
CMD = [BIN] if os.path.exists(BIN) else [sys.executable, "-m", "shmcache.cli"]


def run(*args, timeout=60):
    return subprocess.run(CMD + list(args), capture_output=True, text=True, timeout=timeout)


def assert_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for w in words:
        assert w in lines[0], lines[0]


HOLDER = textwrap.dedent("""
    import sys, time, shmcache
    name, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "create":
        m = shmcache.create_pool(name, block_size=4, max_blocks=32)
    else:
        m = shmcache.attach(name)
    if n:
        m.get_new_blocks(n)
    print("ready", flush=True)
    time.sleep(120)
""")


class Holder:
    """A process that creates (or attaches to) a pool and holds ``n`` blocks."""

    def __init__(self, name, mode="create", n=0):
        self.p = subprocess.Popen([sys.executable, "-c", HOLDER, name, mode, str(n)],
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def kill(self):
        self.p.kill()
        self.p.wait()
        self.p.stdout.close()


@pytest.fixture
def holders():
    made = []

    def factory(*a, **kw):
        h = Holder(*a, **kw)
        made.append(h)
        return h
    yield factory
    for h in made:
        if h.p.poll() is None:
            h.kill()


def busy_pool(make_pool):
    """A pool with tables, a fork, a copy-on-write, cached blocks and a hit."""
    m = make_pool(block_size=4, max_blocks=32, num_layers=1, num_kv_heads=1, head_dim=8)
    t = m.create_block_table("r1")
    blocks = m.prepare_append(t, 10)
    m.cache_full_blocks(blocks, list(range(10)), 0, 2)
    f = m.fork_block_table(t, "r2")
    m.prepare_append(f, 1)                       # copies the shared last block
    got, n = m.acquire_computed_blocks(list(range(10)))
    assert n == 8
    m.get_new_blocks(2)
    return m


@pytest.fixture
def junk_name():
    name = new_name("junk")
    yield name
    segment.unlink(name)


def write_segment(name, data: bytes):
    with open(segment.path_for(name), "wb") as f:
        f.write(data)

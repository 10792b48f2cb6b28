"""The errors of the ``shmcache`` commands: an unknown pool, a file that is
not a pool, another layout version, a corrupt header, a segment others can
write or another user owns. Each is exit 2 and one line, no traceback.

Every command runs as a real subprocess (``tests/_cli.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmcache.shm import layout as L
from shmcache.shm import segment

from conftest import new_name
from _cli import assert_error, run, write_segment
from _cli import junk_name  # pytest fixture

# the fixture imported above, listed so that pyflakes counts it as used
__all__ = ["junk_name"]


# ------------------------------------------------------------------ errors
ERROR_CMDS = [("inspect",), ("inspect", "--json"), ("fsck",), ("fsck", "--repair"),
              ("top",), ("cleanup",)]


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_unknown_pool(cmd):
    r = run(cmd[0], new_name("missing"), *cmd[1:])
    assert_error(r, "no shmcache pool named")


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_not_a_pool(cmd, junk_name):
    write_segment(junk_name, b"hello, not a pool" * 400)
    r = run(cmd[0], junk_name, *cmd[1:])
    assert_error(r, "not a shmcache pool")
    assert os.path.exists(segment.path_for(junk_name))      # never removed


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_incompatible_version(cmd, junk_name):
    hdr = np.zeros(1, L.HEADER_DTYPE)
    hdr["magic"], hdr["version"], hdr["ready"] = L.MAGIC, L.LAYOUT_VERSION + 7, 1
    write_segment(junk_name, hdr.tobytes().ljust(8192, b"\0"))
    r = run(cmd[0], junk_name, *cmd[1:])
    assert_error(r, "layout version")


def test_tiny_segment_and_bad_name(junk_name):
    write_segment(junk_name, b"")
    assert_error(run("inspect", junk_name), "not a shmcache pool")
    assert_error(run("fsck", junk_name), "not a shmcache pool")   # at once, no 5 s wait
    assert_error(run("inspect", "../etc/passwd"), "invalid pool name")


def test_list_reports_unusable_segments(junk_name):
    write_segment(junk_name, b"x" * 100)
    r = run("list")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(junk_name))
    assert "not a shmcache pool" in row


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_segment_others_can_write_is_refused(cmd, make_pool):
    m = make_pool()
    path = segment.path_for(m.name)
    os.chmod(path, 0o666)
    with open(path, "rb") as f:
        before = f.read()
    r = run(cmd[0], m.name, *cmd[1:])
    assert_error(r, "writable by group and others", "0666")
    assert os.path.exists(path)                     # cleanup never removes it either
    with open(path, "rb") as f:
        assert f.read() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid needs root")
def test_segment_of_another_user_is_refused(make_pool):
    m = make_pool()
    os.chown(segment.path_for(m.name), 54321, -1)
    assert_error(run("inspect", m.name), "belongs to uid 54321")
    assert_error(run("fsck", m.name, "--repair"), "belongs to uid 54321")
    r = run("list")
    row = next(line for line in r.stdout.splitlines() if line.startswith(m.name))
    assert "not usable" in row and "54321" in row


@pytest.mark.parametrize("cmd", ERROR_CMDS, ids=lambda c: " ".join(c))
def test_corrupt_header_is_one_line(cmd, make_pool, junk_name):
    """An unknown dtype code was a KeyError traceback in attach, fsck and
    inspect: every header field is checked, and the error is one line."""
    m = make_pool()
    with open(segment.path_for(m.name), "rb") as f:
        data = bytearray(f.read())
    np.frombuffer(data, L.HEADER_DTYPE, 1)["dtype_code"] = 9
    write_segment(junk_name, bytes(data))
    r = run(cmd[0], junk_name, *cmd[1:])
    assert_error(r, "corrupt header", "unknown dtype code 9")
    assert os.path.exists(segment.path_for(junk_name))


@pytest.mark.parametrize("args,words", [
    (("serve", "--handoff-tokens", "-1"), ("--handoff-tokens", "at least 0", "serve --help")),
    (("serve", "--pack-rows", "0"), ("--pack-rows", "at least 1")),
    (("serve", "--workers", "two"), ("--workers", "'two'")),
    (("inspect",), ("required: name", "inspect --help")),
    (("fsck", "x", "--bogus"), ("shmcache fsck: error: unrecognized arguments: --bogus",
                                "fsck --help")),
    (("serve", "--bogus"), ("shmcache serve: error: unrecognized arguments: --bogus",
                            "(see shmcache serve --help)")),
], ids=["handoff-tokens", "pack-rows", "workers", "inspect", "fsck", "serve-unknown"])
def test_a_bad_argument_is_one_line_naming_it(args, words):
    """argparse's errors, without its usage block: one line and exit 2."""
    assert_error(run(*args), *words)

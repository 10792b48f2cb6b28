"""Bad sizes and bad segments: a manager or pool of impossible sizes, a
name with no pool, and a segment that is not a compatible, intact pool are
refused with a clear error, and leave nothing behind."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.manager import paged_cache as pc
from shmcache.errors import IncompatiblePoolError, PoolNotFoundError


@pytest.mark.parametrize("kw", [dict(block_size=0), dict(block_size=-4), dict(max_blocks=0),
                                dict(max_blocks=1), dict(max_blocks=-5), dict(block_size=2.0),
                                dict(max_blocks="10"), dict(block_size=True)])
def test_bad_manager_sizes(kw):
    with pytest.raises((TypeError, ValueError)):
        pc.PagedCacheManager(**kw)


@pytest.mark.parametrize("kw", [dict(num_kv_heads=0), dict(head_dim=0), dict(head_dim=-1),
                                dict(num_layers=-1), dict(max_slots=0), dict(max_tables=0),
                                dict(max_refs=0), dict(dtype="int8"), dict(block_size=0),
                                dict(max_blocks=1), dict(max_slots=L.MAX_SLOTS_LIMIT + 1),
                                dict(max_tables=L.MAX_TABLES_LIMIT + 1),
                                dict(block_size=65536), dict(max_blocks=2**31)])
def test_bad_pool_sizes(pool_name, kw):
    with pytest.raises((TypeError, ValueError)):
        shmcache.create_pool(pool_name, **kw)
    assert not os.path.exists(f"/dev/shm/shmcache.{pool_name}")


def test_attach_nonexistent(pool_name):
    with pytest.raises(PoolNotFoundError):
        shmcache.attach(pool_name)


def _fake_segment(name: str, data: bytes) -> str:
    path = f"/dev/shm/shmcache.{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return path


def _header(**fields) -> bytes:
    h = np.zeros(1, L.HEADER_DTYPE)
    h["magic"] = L.MAGIC
    h["version"] = L.LAYOUT_VERSION
    h["ready"] = 1
    for k, v in dict(block_size=4, max_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype_code=1, max_slots=4, max_tables=8, max_refs=32).items():
        h[k] = v
    for k, v in fields.items():
        h[k] = v
    return h.tobytes().ljust(L.HEADER_SIZE + 4096, b"\0")


@pytest.mark.parametrize("case", ["not a pool", "other version", "never ready", "too small",
                                  "truncated", "zero bytes"])
def test_attach_incompatible_segment(pool_name, case):
    data = {"not a pool": b"hello world, not a pool".ljust(8192, b"\0"),
            "other version": _header(version=L.LAYOUT_VERSION + 1),
            "never ready": _header(ready=0),
            "too small": b"tiny",
            "truncated": _header(max_blocks=1000),
            "zero bytes": b""}[case]
    path = _fake_segment(pool_name, data)
    try:
        with pytest.raises(IncompatiblePoolError) as ei:
            shmcache.attach(pool_name, timeout=0.05)
        assert pool_name in str(ei.value) or path in str(ei.value)
        if case == "other version":
            assert str(L.LAYOUT_VERSION + 1) in str(ei.value)
        assert os.path.exists(path)                          # left alone
        with open(path, "rb") as f:
            assert f.read() == data
    finally:
        os.unlink(path)


def test_creator_survives_failed_attach_of_other_name(make_pool, pool_name):
    m = make_pool()
    path = _fake_segment(pool_name, _header(version=0))
    try:
        with pytest.raises(IncompatiblePoolError):
            shmcache.attach(pool_name, timeout=0.05)
    finally:
        os.unlink(path)
    assert m.check() == [] and m.free_blocks == 31


# ====================================================================== corrupt headers
def _pool_bytes(make_pool) -> bytes:
    m = make_pool(block_size=4, max_blocks=8)
    m.get_new_blocks(2)
    with open(f"/dev/shm/shmcache.{m.name}", "rb") as f:
        return f.read()


@pytest.mark.parametrize("field,value,words", [
    ("max_slots", 1, "total_size"),                 # once: the null block three times
    ("max_blocks", 0, "max_blocks 0"),              # once: block ids of -1
    ("dtype_code", 9, "unknown dtype code 9"),      # once: a KeyError traceback
    ("max_refs", 10**6, "total_size"),
    ("hash_capacity", 4, "hash_capacity 4"),
    ("enable_caching", 7, "enable_caching 7"),
    ("created_at", 1.0, "checksum"),                # sizes agree, the checksum does not
    ("total_size", 1 << 40, "total_size"),
])
def test_attach_refuses_a_corrupt_header(make_pool, pool_name, field, value, words):
    """Every size and offset in the header is checked against the others, the
    layout version and the file's size (and a checksum covers the rest)."""
    from shmcache.errors import CorruptPoolError
    data = bytearray(_pool_bytes(make_pool))
    h = np.frombuffer(data, L.HEADER_DTYPE, 1)
    h[field] = value
    path = _fake_segment(pool_name, bytes(data))
    try:
        with pytest.raises(CorruptPoolError) as ei:
            shmcache.attach(pool_name, timeout=0.05)
        assert words in str(ei.value) and pool_name in str(ei.value)
        assert isinstance(ei.value, IncompatiblePoolError)
        with open(path, "rb") as f:
            assert f.read() == bytes(data)          # left alone
    finally:
        os.unlink(path)


def test_attach_refuses_a_file_of_another_size(make_pool, pool_name):
    from shmcache.errors import CorruptPoolError
    data = _pool_bytes(make_pool)
    for extra in (b"\0" * 4096, None):
        body = data + extra if extra else data[:-4096]
        path = _fake_segment(pool_name, body)
        try:
            with pytest.raises(CorruptPoolError, match="the file is"):
                shmcache.attach(pool_name, timeout=0.05)
        finally:
            os.unlink(path)

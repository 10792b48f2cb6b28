"""The C core's parameters come from one table, ``layout.HOT_PARAMS``: the
committed shmcache/_native/hot_params_gen.h is what the generator writes from
it, the built ``_hot`` was built from it, and every row is one the C code
reads (no dead parameters)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shmcache.shm import hot_params_gen
from shmcache.shm import layout as L

NATIVE = Path(__file__).resolve().parent.parent / "shmcache" / "_native"
GENERATED = NATIVE / "hot_params_gen.h"


def test_the_committed_header_is_what_the_generator_writes():
    assert GENERATED.read_text() == hot_params_gen.header(), (
        f"{GENERATED.name} differs from layout.HOT_PARAMS: regenerate it with "
        f"`{hot_params_gen.COMMAND}` (then rebuild the extension)")


def test_the_built_module_has_the_tables_order():
    hot = pytest.importorskip("shmcache._hot", reason="shmcache._hot is not built here")
    assert hot.PARAM_NAMES == L.HOT_PARAM_NAMES, (
        "shmcache._hot was built from another HOT_PARAMS: rebuild it "
        "(python setup.py build_ext --inplace)")


def test_every_parameter_is_read_by_the_c_code():
    code = "\n".join(p.read_text() for p in sorted(NATIVE.glob("*.[ch]*"))
                     if p.name != GENERATED.name)
    unread = [n for n in L.HOT_PARAM_NAMES if not re.search(rf"\bP_{n.upper()}\b", code)]
    assert not unread, f"rows of layout.HOT_PARAMS no C code reads (drop them): {unread}"
    assert len(set(L.HOT_PARAM_NAMES)) == len(L.HOT_PARAM_NAMES)


def test_the_values_follow_the_layout():
    lay = L.compute_layout(16, 100, True, 2, 2, 8, "float16", 4, 8, 300)
    p = dict(zip(L.HOT_PARAM_NAMES, L.hot_params(lay)))
    assert len(p) == len(L.HOT_PARAMS) and all(type(v) is int for v in p.values())
    # block_record_bytes is the 40-byte record stride, not tokens per block
    assert p["block_record_bytes"] == L.BLOCK_DTYPE.itemsize == 40 != lay.block_size
    assert p["blocks_off"] == lay.blocks_off and p["hash_cap"] == lay.hash_capacity
    assert p["tindex_cap"] == lay.table_capacity and p["max_slots"] == 4
    assert p["t_claim"] == L.TABLE_DTYPE.fields["claim"][1]
    only = dict(zip(L.HOT_PARAM_NAMES, L.hot_params_only(mutex_off=L.MUTEX_OFF, c_holder=14)))
    assert only["mutex_off"] == L.MUTEX_OFF and only["c_holder"] == 14
    assert sum(only.values()) == L.MUTEX_OFF + 14
    with pytest.raises(ValueError, match="block_size"):
        L.hot_params_only(block_size=40)


def test_a_stale_build_is_not_used():
    """A _hot built from another HOT_PARAMS would read the pool through the
    wrong offsets: lock falls back to the reference path and warns. (A unit
    test: a stand-in module plays the stale build, in a fresh interpreter.)"""
    code = ("import sys, types, warnings\n"
            "sys.modules['shmcache._hot'] = types.SimpleNamespace(PARAM_NAMES=('mutex_off',))\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import shmcache.shm.lock as lock\n"
            "assert lock._hot is None and not lock.ACCELERATED, lock._hot\n"
            "assert any('rebuild' in str(x.message) for x in w), [str(x.message) for x in w]\n")
    env = {k: v for k, v in os.environ.items() if k != "SHMCACHE_PURE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr

"""Every header of shmcache/_native/ compiles on its own: a translation unit
that includes only that header passes ``g++ -fsyntax-only``, with no
include path but shmcache/_native/ itself. So each header includes what it
uses, and none needs Python.h (the hot_*.h core is plain C/C++; only the
binding, hot.cpp and its bind_args.h, sees Python and nanobind: that one
header is compiled with their include paths too) or MLX (copy.h is the KV
read's copy loop; mlxbuf.cpp is what includes MLX). Skipped, with the
reason, where g++ (or, for bind_args.h, nanobind) is not installed."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parent.parent / "shmcache" / "_native"
HEADERS = sorted(p.name for p in NATIVE.glob("*.h"))
GXX = shutil.which("g++")


def test_the_headers_are_found():
    assert "hot_params.h" in HEADERS and "copy.h" in HEADERS, HEADERS


@pytest.mark.skipif(GXX is None, reason="g++ is not installed: cannot compile the headers")
@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_on_its_own(header, tmp_path):
    unit = tmp_path / "unit.cpp"
    unit.write_text(f'#include "{header}"\n')
    extra = []
    if "nanobind" in (NATIVE / header).read_text():     # the binding's own header
        nanobind = pytest.importorskip("nanobind", reason="nanobind is not installed: "
                                       f"cannot compile {header}")
        extra = [f"-I{nanobind.include_dir()}", f"-I{sysconfig.get_paths()['include']}"]
    r = subprocess.run([GXX, "-fsyntax-only", "-std=c++17", "-Wall", f"-I{NATIVE}", *extra,
                        str(unit)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr         # (no warnings either)


@pytest.mark.parametrize("header", [h for h in HEADERS if h.startswith("hot_")])
def test_the_core_headers_have_no_python(header):
    text = (NATIVE / header).read_text()
    assert "Python.h" not in text and "Py_" not in text and "nanobind" not in text

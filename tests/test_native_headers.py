"""Every header of shmcache/_native/ compiles on its own: a translation unit
that includes only that header passes ``g++ -fsyntax-only``, with no
include path but shmcache/_native/ itself. So each header includes what it
uses, and none needs Python.h (the hot_*.h core is plain C/C++; only
hot.cpp, the binding, sees Python and nanobind) or MLX (copy.h is the KV
read's copy loop; mlxbuf.cpp is what includes MLX). Skipped, with the
reason, where g++ is not installed."""

from __future__ import annotations

import shutil
import subprocess
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
    r = subprocess.run([GXX, "-fsyntax-only", "-std=c++17", "-Wall", f"-I{NATIVE}", str(unit)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr         # (no warnings either)


@pytest.mark.parametrize("header", [h for h in HEADERS if h.startswith("hot_")])
def test_the_core_headers_have_no_python(header):
    text = (NATIVE / header).read_text()
    assert "Python.h" not in text and "Py_" not in text and "nanobind" not in text

"""Where an optimized CBLAS may be installed, and what a CBLAS library is.

:func:`candidates` lists the files that may be an optimized CBLAS on this
machine, best first; :func:`reference_path` finds the reference BLAS that
the mlx-cpu wheel ships; :func:`classify` names a library ("openblas",
"reference", ...) from the symbols it exports, else from its file name.

Standard library only: :mod:`shmcache.system.blas` runs before mlx is imported.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import sysconfig

from .blas_load import sym

#: the names :func:`classify` gives libraries that are not the reference BLAS
OPTIMIZED = frozenset({"openblas", "blis", "mkl", "flexiblas", "atlas", "accelerate"})


def _multiarch_dirs() -> list[str]:
    triplet = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [f"/usr/lib/{triplet}"] if triplet else []
    for d in sorted(glob.glob("/usr/lib/*-linux-gnu*")):
        if d not in dirs and os.path.isdir(d):
            dirs.append(d)
    return dirs


def candidates() -> list[str]:
    """Existing files that may be an optimized CBLAS, best first.

    OpenBLAS (pthread build first: the OpenMP one does not survive fork
    well), then BLIS, then MKL, then FlexiBLAS (Fedora's switchable BLAS,
    whose default backend there is OpenBLAS). Each must export plain
    ``cblas_sgemm``; ``use_fast_blas`` checks that before using one. The
    scipy-openblas wheels (numpy's OpenBLAS) are not here: they export
    ``scipy_cblas_*`` names and 64-bit integer interfaces, which libmlx
    cannot bind to.
    """
    paths: list[str] = []
    for d in _multiarch_dirs():                                  # Debian, Ubuntu
        paths += [f"{d}/openblas-pthread/libopenblas.so.0", f"{d}/libopenblas.so.0",
                  f"{d}/openblas-serial/libopenblas.so.0",
                  f"{d}/openblas-openmp/libopenblas.so.0"]
    paths += ["/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0",  # Fedora, RHEL
              "/usr/lib64/libopenblaso.so.0",
              "/usr/lib/libopenblas.so.0", "/usr/lib/libopenblas.so.3",        # Arch, Alpine
              "/usr/local/lib/libopenblas.so.0", "/opt/OpenBLAS/lib/libopenblas.so.0"]
    prefixes = [sys.prefix] + [p for p in (os.environ.get("CONDA_PREFIX"),) if p]
    for p in prefixes:                                           # conda, or a venv's lib/
        paths += [f"{p}/lib/libopenblas.so.0"]
    for d in _multiarch_dirs():
        paths += [f"{d}/blis-pthread/libblis.so.4", f"{d}/blis-serial/libblis.so.4",
                  f"{d}/blis-openmp/libblis.so.4"]
    paths += ["/usr/lib64/libblisp.so.4", "/usr/lib64/libblis.so.4", "/usr/lib/libblis.so.4",
              "/usr/local/lib/libblis.so.4"]
    for p in prefixes:              # the PyPI "mkl" wheel installs lib/libmkl_rt.so.N
        paths += [f"{p}/lib/libmkl_rt.so.3", f"{p}/lib/libmkl_rt.so.2"]
    paths += ["/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so.2",
              "/opt/intel/oneapi/mkl/latest/lib/intel64/libmkl_rt.so.2"]
    for d in _multiarch_dirs():
        paths += [f"{d}/libmkl_rt.so", f"{d}/libflexiblas.so.3"]
    paths += ["/usr/lib64/libflexiblas.so.3"]
    seen: set[str] = set()
    out = []
    for p in paths:
        if p not in seen and os.path.exists(p):
            seen.add(p)
            out.append(p)
    return out


def reference_path() -> str | None:
    """The reference BLAS the mlx-cpu wheel ships (without importing mlx)."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(glob.glob(os.path.join(os.path.dirname(loc), "mlx_cpu.libs", "libblas*.so*")))
        if hits:
            return hits[0]
    return None


def classify(path: str, lib) -> str:
    """The library's name: from a symbol only it exports, else from its file name.

    Args:
        path: the library file.
        lib: the loaded library (a ``ctypes.CDLL``), or None if it is not loaded.

    Returns:
        "openblas", "blis", "mkl", "flexiblas", "atlas", "reference" or "unknown".
    """
    if lib is not None:
        for symbol, name in (("openblas_get_config", "openblas"),
                             ("bli_info_get_version_str", "blis"),
                             ("MKL_Get_Version_String", "mkl"),
                             ("flexiblas_current_backend", "flexiblas")):
            if sym(lib, symbol) is not None:
                return name
    base = os.path.basename(os.path.realpath(path)).lower()
    for key in ("openblas", "blis", "mkl", "flexiblas", "atlas"):
        if key in base:
            return key
    if base.startswith(("libblas", "libcblas", "librefblas")):
        return "reference"
    return "unknown"

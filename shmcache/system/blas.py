"""A fast CBLAS under MLX on Linux.

The ``mlx-cpu`` wheel links ``libmlx`` against the reference (netlib) BLAS it
ships in ``mlx_cpu.libs``: a float32 matmul there runs at a few GFLOP/s. The
dynamic linker binds ``libmlx``'s ``cblas_*`` references when ``mlx.core`` is
imported, searching the process's global scope before ``libmlx``'s own
dependencies; so an optimized CBLAS loaded with ``RTLD_GLOBAL`` *before* the
first ``import mlx`` takes those calls over (the same thing ``LD_PRELOAD``
does, without touching the command line).

``import shmcache`` calls :func:`use_fast_blas` first thing, so a process that
imports shmcache before mlx gets the fast library. Environment:

    SHMCACHE_BLAS=off            keep MLX's reference BLAS
    SHMCACHE_BLAS=/path/lib.so   use this library (it must export cblas_sgemm)
    SHMCACHE_BLAS_THREADS=N      BLAS threads per process (default 1)

The work is split by role: :mod:`shmcache.system.blas_find` (which files may be a
CBLAS, and naming one), :mod:`shmcache.system.blas_load` (loading one globally, its
thread count) and :mod:`shmcache.system.blas_elf` (which library libmlx is bound
to). These modules import only the standard library: they must not import
mlx.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass

from .blas_elf import bound_in, file_of, global_addr, libmlx_loaded
from .blas_find import OPTIMIZED, candidates, classify, reference_path
from .blas_load import get_threads, load_global, set_threads

__all__ = ["BlasInfo", "use_fast_blas", "info", "threads", "matmul_gflops", "candidates"]

log = logging.getLogger(__name__)

_OFF = frozenset({"off", "0", "no", "false", "none", "reference"})
_AUTO = frozenset({"", "auto", "on", "1", "yes", "true"})


@dataclass(frozen=True)
class BlasInfo:
    """Which CBLAS serves MLX's matmuls in this process.

    path: the library file that provides ``cblas_sgemm`` (as the dynamic
        linker loaded it), or None where there is none to name (macOS).
    name: "openblas", "blis", "mkl", "flexiblas", "reference", "accelerate"
        or "unknown".
    threads: the library's thread count (the reference BLAS is
        single-threaded: 1), None if unknown.
    optimized: name is not the reference BLAS.
    bound: True when read from libmlx's own relocation (mlx is loaded and its
        ``cblas_sgemm`` slot points into ``path``); False when mlx is not
        loaded yet and ``path`` is what it will bind to.
    detail: one line on how this came about.
    """

    path: str | None
    name: str
    threads: int | None
    optimized: bool
    bound: bool
    detail: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


class _State:
    lib: ctypes.CDLL | None = None      # the library use_fast_blas loaded
    path: str | None = None
    detail: str = ""
    warned_late = False


_state = _State()


# ------------------------------------------------------------ threads
def threads_from_env(environ=None) -> int | None:
    """``SHMCACHE_BLAS_THREADS`` of ``environ`` (default ``os.environ``) as a
    positive int; None where it is unset, empty or not one."""
    raw = (os.environ if environ is None else environ).get("SHMCACHE_BLAS_THREADS", "").strip()
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if n >= 1 else None


def _default_threads() -> int:
    n = threads_from_env()
    if n is not None:
        return n
    raw = os.environ.get("SHMCACHE_BLAS_THREADS", "").strip()
    if raw:
        warnings.warn(f"shmcache.system.blas: SHMCACHE_BLAS_THREADS={raw!r} is not a positive "
                      "integer; using 1", RuntimeWarning, stacklevel=3)
    return 1


def _mlx_loaded() -> bool:
    return "mlx.core" in sys.modules or libmlx_loaded() is not None


def use_fast_blas(threads: int | None = None) -> BlasInfo:
    """Make MLX's CPU matmuls use an optimized CBLAS; call before mlx is imported.

    On Linux, loads the first of :func:`candidates` that exports
    ``cblas_sgemm`` (or the library that ``SHMCACHE_BLAS`` names) with
    ``RTLD_GLOBAL``, so that libmlx binds its ``cblas_*`` references to it
    when mlx is imported, and sets its thread count.

    threads: BLAS threads in this process. The default is 1
    (``SHMCACHE_BLAS_THREADS`` overrides it): shmcache serves a model from
    one worker process per core, so each worker already has a core of its
    own; more BLAS threads per worker would put several threads on each core
    (oversubscription), and they would slow each other down through context
    switches, cache thrashing and OpenBLAS's spin-waiting. A single process
    that has the machine to itself may ask for ``os.cpu_count()``.

    Once a library was loaded, a later call only changes its thread count
    (which works after mlx is imported too). When mlx was imported first and
    still uses the reference BLAS, nothing can be changed: it only reports,
    and warns once that it is too late. On macOS it does nothing (MLX uses
    Metal and Accelerate). ``SHMCACHE_BLAS=off`` disables it.

    Returns :func:`info`. Raises nothing for a missing library: it warns.
    """
    if not sys.platform.startswith("linux"):
        return info()
    setting = os.environ.get("SHMCACHE_BLAS", "").strip()
    if setting.lower() in _OFF:
        _state.detail = f"disabled by SHMCACHE_BLAS={setting}"
        return info()
    explicit = threads is not None
    n = int(threads) if threads is not None else _default_threads()
    if n < 1:
        raise ValueError(f"threads must be >= 1, not {threads!r}")
    if _state.lib is not None:
        if explicit:
            set_threads(_state.lib, n)
        return info()
    if _mlx_loaded():
        found = info()
        if found.optimized:          # e.g. LD_PRELOAD: only the thread count to set
            try:
                _state.lib = ctypes.CDLL(found.path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                _state.path = found.path
                set_threads(_state.lib, n)
            except OSError:
                pass
            _state.detail = f"mlx was loaded first, already bound to {found.name}"
            return info()
        _state.detail = ("too late: mlx was imported before shmcache.system.blas.use_fast_blas(); "
                         "import shmcache first")
        if not _state.warned_late:
            _state.warned_late = True
            warnings.warn(f"shmcache.system.blas: {_state.detail} (MLX keeps the reference BLAS: "
                          "slow CPU matmuls)", RuntimeWarning, stacklevel=2)
        return info()
    if setting.lower() in _AUTO:
        paths, why = candidates(), "found by search"
    else:
        paths, why = [setting], "chosen by SHMCACHE_BLAS"
    errors = []
    for path in paths:
        try:
            _state.lib = load_global(path, n)
        except OSError as e:
            errors.append(str(e))
            continue
        _state.path = path
        _state.detail = f"{why}; loaded with RTLD_GLOBAL before mlx"
        log.debug("shmcache.system.blas: %s", _state.detail)
        return info()
    if not paths:
        _state.detail = ("no optimized CBLAS installed (on Debian: apt-get install "
                         "libopenblas0-pthread); MLX uses the reference BLAS")
        log.info("shmcache.system.blas: %s", _state.detail)
    else:
        _state.detail = "could not load " + "; ".join(errors) + ": MLX uses the reference BLAS"
        warnings.warn(f"shmcache.system.blas: {_state.detail}", RuntimeWarning, stacklevel=2)
    return info()


def threads() -> int | None:
    """The thread count of the BLAS this module loaded (cheap: one call into
    it), or None where it loaded none (macOS, disabled, mlx first)."""
    return get_threads(_state.lib) if _state.lib is not None else None


def info() -> BlasInfo:
    """The CBLAS library that MLX's ``cblas_sgemm`` calls go to in this process.

    With mlx loaded, reads the address in libmlx's own relocation slot for
    ``cblas_sgemm`` and names the file it lies in (``dladdr``): that is the
    binding actually in use, not a guess. Without mlx, names what it will
    bind to: the global scope's ``cblas_sgemm`` if any, else the reference
    BLAS of the mlx-cpu wheel.
    """
    detail = _state.detail
    if sys.platform == "darwin":
        return BlasInfo(None, "accelerate", None, True, False,
                        "macOS: MLX uses Metal and Accelerate")
    if not sys.platform.startswith("linux"):
        return BlasInfo(None, "unknown", None, False, False, f"not handled on {sys.platform}")
    libmlx = libmlx_loaded()
    path, bound = None, False
    if libmlx:
        path = file_of(bound_in(libmlx, "cblas_sgemm"))
        bound = path is not None
        if path is None:
            # no readable relocation: the global scope wins if it has one,
            # else libmlx's own dependencies (its dlsym search order)
            path = file_of(global_addr("cblas_sgemm"))
            if path is None:
                try:
                    lib = ctypes.CDLL(libmlx, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                    path = file_of(ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value)
                except (OSError, AttributeError):
                    path = None
    else:
        path = file_of(global_addr("cblas_sgemm")) or reference_path()
        if not detail:
            detail = "mlx is not loaded yet: the library it will bind to"
    if path is None:
        return BlasInfo(None, "unknown", None, False, bound, detail or "no cblas_sgemm found")
    try:
        loaded: ctypes.CDLL | None = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        loaded = None                  # not loaded (yet): the mlx-cpu reference
    name = classify(path, loaded)
    threads = get_threads(loaded) if loaded is not None else None
    if threads is None and name == "reference":
        threads = 1
    return BlasInfo(os.path.normpath(path), name, threads, name in OPTIMIZED, bound, detail)


# ------------------------------------------------------------ measuring
def matmul_gflops(n: int = 1024, repeats: int = 3) -> float:
    """GFLOP/s of an evaluated n x n x n float32 matmul in MLX (best of repeats)."""
    import mlx.core as mx
    k1, k2 = mx.random.split(mx.random.key(0))
    a = mx.random.normal((n, n), dtype=mx.float32, key=k1)
    b = mx.random.normal((n, n), dtype=mx.float32, key=k2)
    mx.eval(a, b)
    mx.eval(a @ b)                                   # warm up
    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best / 1e9

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

This module imports only the standard library: it must not import mlx.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import mmap
import os
import struct
import sys
import sysconfig
import time
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache

__all__ = ["BlasInfo", "use_fast_blas", "info", "matmul_gflops", "candidates"]

log = logging.getLogger(__name__)

#: the names :func:`info` reports for libraries that are not the reference BLAS
OPTIMIZED = frozenset({"openblas", "blis", "mkl", "flexiblas", "atlas", "accelerate"})
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


# ------------------------------------------------------------ candidates
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


# ------------------------------------------------------------ threads
def _default_threads() -> int:
    raw = os.environ.get("SHMCACHE_BLAS_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
            if n >= 1:
                return n
        except ValueError:
            pass
        warnings.warn(f"shmcache.blas: SHMCACHE_BLAS_THREADS={raw!r} is not a positive "
                      "integer; using 1", RuntimeWarning, stacklevel=3)
    return 1


def _sym(lib, name):
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


def _set_threads(lib, n: int) -> None:
    f = _sym(lib, "openblas_set_num_threads")
    if f is not None:
        f.argtypes, f.restype = [ctypes.c_int], None
        f(n)
    f = _sym(lib, "bli_thread_set_num_threads")
    if f is not None:
        f.argtypes, f.restype = [ctypes.c_int64], None
        f(n)
    f = _sym(lib, "MKL_Set_Num_Threads")
    if f is not None:
        f.argtypes, f.restype = [ctypes.c_int], None
        f(n)
    f = _sym(lib, "flexiblas_set_num_threads")
    if f is not None:
        f.argtypes, f.restype = [ctypes.c_int], None
        f(n)


def _get_threads(lib) -> int | None:
    for name, restype in (("openblas_get_num_threads", ctypes.c_int),
                          ("bli_thread_get_num_threads", ctypes.c_int64),
                          ("MKL_Get_Max_Threads", ctypes.c_int),
                          ("flexiblas_get_num_threads", ctypes.c_int)):
        f = _sym(lib, name)
        if f is not None:
            f.argtypes, f.restype = [], restype
            return int(f())
    return None


# ------------------------------------------------------------ loading
def _libmlx_loaded() -> str | None:
    """The path of the libmlx mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                i = line.find("/")
                if i >= 0 and os.path.basename(line[i:].rstrip("\n")).startswith("libmlx.so"):
                    return line[i:].rstrip("\n")
    except OSError:
        pass
    return None


def _mlx_loaded() -> bool:
    return "mlx.core" in sys.modules or _libmlx_loaded() is not None


def _load(path: str, threads: int) -> ctypes.CDLL:
    """dlopen path globally, with threads threads; raise OSError if it is no CBLAS."""
    # OpenBLAS and BLIS read these once, when loaded, and size their thread
    # pools from them: set them only for the load, so that one library per
    # process does not start a thread per core that we then leave idle, and
    # so that child processes and numpy's own OpenBLAS do not inherit them.
    env = {"OPENBLAS_NUM_THREADS": str(threads), "BLIS_NUM_THREADS": str(threads)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        probe = ctypes.CDLL(path, mode=os.RTLD_LOCAL)      # check before going global
        if _sym(probe, "cblas_sgemm") is None:
            raise OSError(f"{path} does not export cblas_sgemm")
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    f = _sym(lib, "MKL_Set_Threading_Layer")
    if f is not None and "MKL_THREADING_LAYER" not in os.environ:
        # before any other MKL call: the default (Intel OpenMP) layer needs
        # libiomp5, which the PyPI wheel leaves to the intel-openmp package
        f.argtypes, f.restype = [ctypes.c_int], ctypes.c_int
        f(3 if threads > 1 and _loadable("libgomp.so.1") else 1)   # MKL_THREADING_GNU, _SEQUENTIAL
    _set_threads(lib, threads)
    return lib


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


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
    n = int(threads) if explicit else _default_threads()
    if n < 1:
        raise ValueError(f"threads must be >= 1, not {threads!r}")
    if _state.lib is not None:
        if explicit:
            _set_threads(_state.lib, n)
        return info()
    if _mlx_loaded():
        found = info()
        if found.optimized:          # e.g. LD_PRELOAD: only the thread count to set
            try:
                _state.lib = ctypes.CDLL(found.path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                _state.path = found.path
                _set_threads(_state.lib, n)
            except OSError:
                pass
            _state.detail = f"mlx was loaded first, already bound to {found.name}"
            return info()
        _state.detail = ("too late: mlx was imported before shmcache.blas.use_fast_blas(); "
                         "import shmcache first")
        if not _state.warned_late:
            _state.warned_late = True
            warnings.warn(f"shmcache.blas: {_state.detail} (MLX keeps the reference BLAS: "
                          "slow CPU matmuls)", RuntimeWarning, stacklevel=2)
        return info()
    if setting.lower() in _AUTO:
        paths, why = candidates(), "found by search"
    else:
        paths, why = [setting], "chosen by SHMCACHE_BLAS"
    errors = []
    for path in paths:
        try:
            _state.lib = _load(path, n)
        except OSError as e:
            errors.append(str(e))
            continue
        _state.path = path
        _state.detail = f"{why}; loaded with RTLD_GLOBAL before mlx"
        log.debug("shmcache.blas: %s", _state.detail)
        return info()
    if not paths:
        _state.detail = ("no optimized CBLAS installed (on Debian: apt-get install "
                         "libopenblas0-pthread); MLX uses the reference BLAS")
        log.info("shmcache.blas: %s", _state.detail)
    else:
        _state.detail = "could not load " + "; ".join(errors) + ": MLX uses the reference BLAS"
        warnings.warn(f"shmcache.blas: {_state.detail}", RuntimeWarning, stacklevel=2)
    return info()


# ------------------------------------------------------------ what is bound
class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


@lru_cache(maxsize=1)
def _libdl():
    for name in (None, "libdl.so.2"):
        try:
            lib = ctypes.CDLL(name)
            lib.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
            lib.dladdr.restype = ctypes.c_int
            lib.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.dlinfo.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _file_of(addr: int | None) -> str | None:
    """The file that holds address addr (dladdr), or None."""
    dl = _libdl()
    if not addr or dl is None:
        return None
    d = _DlInfo()
    if not dl.dladdr(ctypes.c_void_p(addr), ctypes.byref(d)) or not d.dli_fname:
        return None
    return os.fsdecode(d.dli_fname)


def _global_addr(symbol: str) -> int | None:
    """The address symbol has in the process's global scope (dlsym), or None."""
    try:
        return ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None


@lru_cache(maxsize=4)
def _reloc_offsets(path: str, symbol: str) -> tuple[int, ...]:
    """The link-time addresses of path's relocation slots (GOT entries) for symbol.

    Reads the ELF file's .dynsym and its SHT_RELA sections; () if it is not a
    little-endian ELF64 file or has no such relocation.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _scan_relocs(data, symbol.encode())


def _scan_relocs(data, want: bytes) -> tuple[int, ...]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return ()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for ridx, s in enumerate(secs):
        if s[1] != 4 or s[9] == 0:                     # SHT_RELA
            continue
        symtab = secs[s[6]]
        if symtab[1] != 11:                             # SHT_DYNSYM
            continue
        strtab = secs[symtab[6]]
        str_off, sym_off = strtab[4], symtab[4]
        for off in range(s[4], s[4] + s[5], s[9]):
            r_offset, r_info = struct.unpack_from("<QQ", data, off)
            isym = r_info >> 32
            if isym == 0:
                continue
            st_name, = struct.unpack_from("<I", data, sym_off + isym * 24)
            start = str_off + st_name
            if data[start:start + len(want) + 1] == want + b"\0":
                out.append(r_offset)
    return tuple(out)


def _load_bias(handle: int) -> int | None:
    """l_addr of a loaded object (dlinfo RTLD_DI_LINKMAP), or None."""
    dl = _libdl()
    if dl is None:
        return None
    lm = ctypes.c_void_p()
    if dl.dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(lm)) != 0 or not lm.value:
        return None
    return ctypes.c_size_t.from_address(lm.value).value     # struct link_map: l_addr first


def _bound_in(libpath: str, symbol: str) -> int | None:
    """Where the loaded library libpath's reference to symbol points now (its GOT slot)."""
    try:
        h = ctypes.CDLL(libpath, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
        offsets = _reloc_offsets(libpath, symbol)
    except (OSError, ValueError, struct.error, IndexError):
        return None
    bias = _load_bias(h)
    if bias is None or not offsets:
        return None
    own = os.path.realpath(libpath)
    for off in offsets:
        target = ctypes.c_void_p.from_address(bias + off).value
        f = _file_of(target)
        if f and os.path.realpath(f) != own:      # not a lazy-binding stub of its own PLT
            return target
    return None


def _reference_path() -> str | None:
    """The reference BLAS the mlx-cpu wheel ships (without importing mlx)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(glob.glob(os.path.join(os.path.dirname(loc), "mlx_cpu.libs", "libblas*.so*")))
        if hits:
            return hits[0]
    return None


def _classify(path: str, lib) -> str:
    if lib is not None:
        for sym, name in (("openblas_get_config", "openblas"), ("bli_info_get_version_str", "blis"),
                          ("MKL_Get_Version_String", "mkl"),
                          ("flexiblas_current_backend", "flexiblas")):
            if _sym(lib, sym) is not None:
                return name
    base = os.path.basename(os.path.realpath(path)).lower()
    for key in ("openblas", "blis", "mkl", "flexiblas", "atlas"):
        if key in base:
            return key
    if base.startswith(("libblas", "libcblas", "librefblas")):
        return "reference"
    return "unknown"


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
    libmlx = _libmlx_loaded()
    path, bound = None, False
    if libmlx:
        path = _file_of(_bound_in(libmlx, "cblas_sgemm"))
        bound = path is not None
        if path is None:
            # no readable relocation: the global scope wins if it has one,
            # else libmlx's own dependencies (its dlsym search order)
            path = _file_of(_global_addr("cblas_sgemm"))
            if path is None:
                try:
                    lib = ctypes.CDLL(libmlx, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                    path = _file_of(ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value)
                except (OSError, AttributeError):
                    path = None
    else:
        path = _file_of(_global_addr("cblas_sgemm")) or _reference_path()
        if not detail:
            detail = "mlx is not loaded yet: the library it will bind to"
    if path is None:
        return BlasInfo(None, "unknown", None, False, bound, detail or "no cblas_sgemm found")
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        lib = None                     # not loaded (yet): the mlx-cpu reference
    name = _classify(path, lib)
    threads = _get_threads(lib) if lib is not None else None
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

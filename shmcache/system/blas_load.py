"""Loading a CBLAS into the process's global scope, and its thread count.

:func:`load_global` dlopens a library with ``RTLD_GLOBAL``, so that libmlx,
loaded later, binds its ``cblas_*`` references to it. :func:`set_threads`
and :func:`get_threads` call whichever of OpenBLAS's, BLIS's, MKL's or
FlexiBLAS's thread functions the library exports.

Standard library only: :mod:`shmcache.system.blas` runs before mlx is imported.
"""

from __future__ import annotations

import ctypes
import os


def sym(lib, name):
    """``lib``'s function ``name`` (a ctypes function), or None if it has none."""
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


# each BLAS's thread-count setter and getter, and the C type of the count
_THREAD_CALLS = (("openblas_set_num_threads", "openblas_get_num_threads", ctypes.c_int),
                 ("bli_thread_set_num_threads", "bli_thread_get_num_threads", ctypes.c_int64),
                 ("MKL_Set_Num_Threads", "MKL_Get_Max_Threads", ctypes.c_int),
                 ("flexiblas_set_num_threads", "flexiblas_get_num_threads", ctypes.c_int))


def set_threads(lib, n: int) -> None:
    """Sets the library's thread count to n with each thread setter it exports."""
    for setter, _, ctype in _THREAD_CALLS:
        f = sym(lib, setter)
        if f is not None:
            f.argtypes, f.restype = [ctype], None
            f(n)


def get_threads(lib) -> int | None:
    """The library's thread count, or None if it exports no getter we know."""
    for _, getter, ctype in _THREAD_CALLS:
        f = sym(lib, getter)
        if f is not None:
            f.argtypes, f.restype = [], ctype
            return int(f())
    return None


def load_global(path: str, threads: int) -> ctypes.CDLL:
    """dlopen path globally (``RTLD_GLOBAL``) and set its thread count.

    Args:
        path: the library file.
        threads: its thread count.

    Returns:
        The loaded library.

    Raises:
        OSError: it cannot be loaded, or does not export ``cblas_sgemm``.
    """
    # OpenBLAS and BLIS read these once, when loaded, and size their thread
    # pools from them: set them only for the load, so that one library per
    # process does not start a thread per core that we then leave idle, and
    # so that child processes and numpy's own OpenBLAS do not inherit them.
    env = {"OPENBLAS_NUM_THREADS": str(threads), "BLIS_NUM_THREADS": str(threads)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        probe = ctypes.CDLL(path, mode=os.RTLD_LOCAL)      # check before going global
        if sym(probe, "cblas_sgemm") is None:
            raise OSError(f"{path} does not export cblas_sgemm")
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    f = sym(lib, "MKL_Set_Threading_Layer")
    if f is not None and "MKL_THREADING_LAYER" not in os.environ:
        # before any other MKL call: the default (Intel OpenMP) layer needs
        # libiomp5, which the PyPI wheel leaves to the intel-openmp package
        f.argtypes, f.restype = [ctypes.c_int], ctypes.c_int
        f(3 if threads > 1 and loadable("libgomp.so.1") else 1)   # MKL_THREADING_GNU, _SEQUENTIAL
    set_threads(lib, threads)
    return lib


def loadable(name: str) -> bool:
    """Whether the dynamic linker can load the library ``name``."""
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


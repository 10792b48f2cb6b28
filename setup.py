"""Build script for the native accelerators (everything else is in pyproject.toml).

``shmcache._hot`` (C, ``shmcache/_native/hot.c`` and ``hot_mutex.h``) holds
the pool's robust mutex calls and the fused allocate/free paths; it is
required on Linux, the platform shmcache runs on, so a build that cannot
compile it fails instead of installing a slower package (elsewhere it stays
optional). ``shmcache._mlxbuf`` (C++, ``shmcache/_native/mlxbuf.cpp``, built
against MLX's headers with nanobind, as MLX's own bindings are) copies a KV
read straight into new MLX arrays; it is optional. The Python paths stay as
the reference and the fallback (``SHMCACHE_PURE=1``, or a module not built):
the same mutex through ctypes, the same operations in Python
(``shmcache/fastpath.py``), and numpy for the KV read (``shmcache/kv.py``),
only slower.
"""

import os
import sys

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall"]


def _mlxbuf():
    # nanobind and MLX are build requirements (pyproject.toml); without them,
    # or on a platform where we do not know how to link MLX, skip the module.
    try:
        import mlx
        import mlx.core as mx
        import nanobind
    except Exception as e:                # not installed, or MLX cannot load here
        print(f"shmcache: not building shmcache._mlxbuf ({e})", file=sys.stderr)
        return []
    if not sys.platform.startswith(("linux", "darwin")):
        return []
    root = list(mlx.__path__)[0]       # mlx is a namespace package: no __file__
    nb = nanobind.source_dir()
    link = []
    if sys.platform == "darwin":
        link = ["-Wl,-rpath,@loader_path/../mlx/lib", "-undefined", "dynamic_lookup"]
    return [Extension(
        "shmcache._mlxbuf",
        ["shmcache/_native/mlxbuf.cpp", os.path.join(nb, "nb_combined.cpp")],
        depends=["shmcache/_native/copy.h"],
        optional=True, language="c++",
        include_dirs=[nanobind.include_dir(), os.path.join(nb, "..", "ext", "robin_map", "include"),
                      os.path.join(root, "include")],
        # NB_DOMAIN=mlx: share MLX's nanobind type registry, so that the
        # arrays we return are mlx.core.array.
        define_macros=[("NB_DOMAIN", "mlx"), ("NB_COMPACT_ASSERTIONS", None), ("NDEBUG", None),
                       ("SHMCACHE_MLX_VERSION", mx.__version__)],
        extra_compile_args=["-O2", "-std=c++20", "-fvisibility=hidden", "-fno-strict-aliasing"],
        library_dirs=[os.path.join(root, "lib")], libraries=["mlx"], extra_link_args=link,
    )]


setup(ext_modules=[
    Extension("shmcache._hot", ["shmcache/_native/hot.c"],
              depends=["shmcache/_native/hot_params.h", "shmcache/_native/hot_mutex.h",
                       "shmcache/_native/hot_localmap.h", "shmcache/_native/hot_loose.h",
                       "shmcache/_native/hot_tables.h", "shmcache/_native/hot_append.h",
                       "shmcache/_native/hot_index.h"],
              optional=not sys.platform.startswith("linux"), extra_compile_args=_FLAGS),
    *_mlxbuf(),
])

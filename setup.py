"""Build script for the native accelerators (everything else is in pyproject.toml).

Both are C++ bound with nanobind (a build requirement), from
``shmcache/_native/``. ``shmcache._hot`` (``hot.cpp`` and ``bind_args.h``, the binding, over the
``hot_*.h`` headers: a C core with no Python) holds the pool's robust mutex
calls and the fused allocate/free and table paths; it is required on Linux,
the platform shmcache runs on, so a build that cannot compile it fails
instead of installing a slower package (elsewhere it stays optional); it
does not use MLX. ``shmcache._mlxbuf`` (``mlxbuf.cpp``, built against MLX's
headers, as MLX's own bindings are) copies a KV read straight into new MLX
arrays and builds weight arrays over a shared file mapping (shmcache/models/weights.py);
it is optional. The Python paths stay as the reference and the
fallback (``SHMCACHE_PURE=1``, or a module not built): the same mutex
through ctypes, the same operations in Python (``shmcache/manager/fastpath.py``),
and numpy for the KV read (``shmcache/manager/kv.py``), only slower.
"""

import os
import sys

from setuptools import Extension, setup

_LINUX = sys.platform.startswith("linux")
# _hot's flags; -fno-strict-aliasing: its core reads the pool's records
# through pointer casts into one mapping
_HOT_FLAGS = ["-O2", "-Wall", "-std=c++17", "-fvisibility=hidden", "-fno-strict-aliasing"]
# (hot_params_gen.h is generated from layout.py and committed: the build
# reads it and imports nothing of shmcache)
_HOT_HEADERS = ["hot_params.h", "hot_params_gen.h", "hot_mutex.h", "hot_enter.h",
                "hot_localmap.h", "hot_loose.h", "hot_reserve.h", "hot_claim.h", "hot_tables.h",
                "hot_append.h", "hot_index.h", "hot_fused.h", "bind_args.h", "bind_tables.h"]


def _hot():
    # required on Linux: without nanobind there, fail the build (the import
    # error says why) instead of installing the slow path
    try:
        import nanobind
    except ImportError as e:
        if _LINUX:
            raise
        print(f"shmcache: not building shmcache._hot ({e})", file=sys.stderr)
        return []
    nb = nanobind.source_dir()
    return [Extension(
        "shmcache._hot",
        ["shmcache/_native/hot.cpp", os.path.join(nb, "nb_combined.cpp")],
        depends=[f"shmcache/_native/{h}" for h in _HOT_HEADERS],
        optional=not _LINUX, language="c++",
        include_dirs=[nanobind.include_dir(), os.path.join(nb, "..", "ext", "robin_map", "include")],
        # a domain of its own (not MLX's, which _mlxbuf joins, nor the
        # default one): its types and its leak-warning setting stay its own
        define_macros=[("NB_DOMAIN", "shmcache"), ("NB_COMPACT_ASSERTIONS", None), ("NDEBUG", None)],
        extra_compile_args=_HOT_FLAGS,
    )]


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


setup(ext_modules=[*_hot(), *_mlxbuf()])

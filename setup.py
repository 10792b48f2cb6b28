"""Build script for the optional C accelerators (everything else is in pyproject.toml).

``shmcache._hot`` holds the pool's robust mutex calls and the fused
allocate/free paths; ``shmcache._gather`` the KV read's gather copy. Both are
optional: where they cannot be compiled, the package installs without them and
uses the same mutex through ctypes, the same operations in Python
(``shmcache/fastpath.py``) and numpy's ``take`` for the gather, only slower.
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall"]

setup(ext_modules=[
    Extension("shmcache._hot", ["shmcache/_hot.c"], optional=True, extra_compile_args=_FLAGS),
    Extension("shmcache._gather", ["shmcache/_gather.c"], optional=True,
              extra_compile_args=_FLAGS + ["-pthread"], extra_link_args=["-pthread"]),
])

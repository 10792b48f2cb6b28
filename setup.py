"""Build script for the optional C accelerator (everything else is in pyproject.toml).

``shmcache._hot`` holds the pool's robust mutex calls and the fused
allocate/free paths. It is optional: where it cannot be compiled, the
package installs without it and uses the same mutex through ctypes and the
same operations in Python (``shmcache/fastpath.py``), only slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shmcache._hot", ["shmcache/_hot.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall"])])

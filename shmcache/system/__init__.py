"""The machine under the pool: the platform seam and the BLAS binding.

Everything here speaks to the operating system or to native libraries, and
nothing here knows what a pool is.

* ``platform`` is the one seam between the pool and the OS: shared-memory
  files, byte-range locks, process identity (pid + start time, so a reused
  pid is never taken for a live holder), futex-style waits.
  ``platform_linux`` is its only implementation; another OS is one more
  module behind the same names.
* ``blas`` chooses the CBLAS that MLX's CPU matmuls call (``blas_find``
  looks for candidates, ``blas_elf`` reads what a shared object exports,
  ``blas_load`` binds it before mlx loads). It imports only the standard
  library, so ``import shmcache`` can run it first; it never raises.

Invariant: no module here imports from the layers above (``shm``, ``pool``,
``manager``, ...); ``tests/test_layers.py`` enforces it.
"""

"""The platform seam: the OS-specific parts shmcache stands on.

Every module takes these names from here, never from a backend:

- ``SHM_DIR``, ``free_bytes``, ``open_unnamed``, ``link_fd``, ``reserve``:
  the segment's directory and file;
- ``byte_lock``, ``byte_unlock``, ``byte_held_by_other``: per-byte locks the
  kernel drops when their holder dies (liveness, the creation lock);
- ``RobustMutex``, ``LOCK_SLICE_S``: the pool mutex, which passes to the
  next locker when its holder dies, waited on in bounded slices.

Only Linux has a backend (``platform_linux``). docs/design.md ("Platform
notes") says how a macOS one would do each of these.
"""

from __future__ import annotations

import sys

if sys.platform.startswith("linux"):
    from .platform_linux import (DEAD_OWNER_SLICES, LOCK_SLICE_S, SHM_DIR, RobustMutex,
                                 byte_held_by_other, byte_lock, byte_unlock, free_bytes,
                                 link_fd, open_unnamed, reserve)
else:                                              # pragma: no cover - Linux CI
    raise ImportError(f"shmcache runs on Linux only (this is {sys.platform}): it needs robust "
                      "process-shared mutexes and OFD locks; see docs/design.md, Platform notes")

__all__ = ["SHM_DIR", "free_bytes", "open_unnamed", "link_fd", "reserve", "byte_lock",
           "byte_unlock", "byte_held_by_other", "RobustMutex", "LOCK_SLICE_S",
           "DEAD_OWNER_SLICES"]

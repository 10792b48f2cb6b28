"""Who is blocked on a pool's lock, as the kernel sees it (Linux /proc).

Used by the stress tool's ``--kill-waiters`` (to SIGKILL a process while it
sleeps on the lock) and by the tests' handshakes.
"""

from __future__ import annotations

import os
import platform

_FUTEX_NR = {"x86_64": 202, "aarch64": 98}


def lock_waiters(path: str, pids=None) -> set:
    """Pids with a thread blocked in futex() on the pool mutex of ``path``.

    Each process maps the segment at its own address, found in its maps by
    the segment's inode; a thread waits on the lock when its current system
    call is futex() on that address. ``pids`` limits the scan (default: all).
    """
    from shmcache.shm import layout as L
    ino = str(os.stat(path).st_ino)
    nr = str(_FUTEX_NR[platform.machine()])
    out = set()
    for pid in (pids if pids is not None else filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/maps") as f:
                addrs = {int(ln.split("-", 1)[0], 16) + L.MUTEX_OFF
                         for ln in f if ln.split()[4:5] == [ino] and ln.split()[2] == "00000000"}
            if not addrs:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                    sc = f.read().split()
                if len(sc) > 1 and sc[0] == nr and int(sc[1], 16) in addrs:
                    out.add(int(pid))
        except (OSError, ValueError, IndexError):
            continue        # gone, or not ours to read
    return out

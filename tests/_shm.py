"""Where the segment tests look in /dev/shm (``test_segment``,
``test_segment_lifetime``, ``test_segment_creation``): a named pool's file,
and this process's private pools."""

from __future__ import annotations

import os

from shmcache.shm import segment


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", "shmcache." + name)


def private_names() -> list:
    return [n for n in segment.list_names() if n.startswith(f"private-{os.getpid()}-")]

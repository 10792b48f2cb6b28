"""Messages between the server (supervisor) and its worker processes.

Each message is one msgspec Struct of a tagged union, MessagePack-encoded
(decoding cannot run code, unlike pickle) and framed with a 4-byte
little-endian length, over the worker's stdin (to it) and a private copy of
its stdout (from it; the worker points fd 1 at stderr, so a library that
prints cannot corrupt the stream).
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Optional, Union

import msgspec

from .protocol import SamplingParams, TokenLogprob

#: the environment variable through which the supervisor hands a worker the
#: L2 cluster secret (hex), not on its command line
L2_SECRET_ENV = "SHMCACHE_L2_SECRET"

#: the environment variable through which the supervisor gives a worker the
#: CPUs it runs on with ``--pin-cores`` ("3,4"): the worker applies it before
#: it loads the BLAS, so every thread it starts inherits it
WORKER_CPUS_ENV = "SHMCACHE_WORKER_CPUS"


# ------------------------------------------------------------- to a worker
class Gen(msgspec.Struct, tag="gen"):
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int                      # the request's seed (the supervisor picks one if unset)
    # a prefill handed over through the pool (``Handoff``): ``handoff``:
    # compute prompt[:-1], keep its table, report ``Handoff`` and decode
    # nothing; ``adopt``: start from a fork of that table (another worker's,
    # named here) instead of computing; gone, the request computes as usual
    handoff: bool = False
    adopt: str = ""


class Cancel(msgspec.Struct, tag="cancel"):
    id: int


class Unpark(msgspec.Struct, tag="unpark"):
    """Drop the table kept for request ``id`` after its ``Handoff`` (the
    worker that adopted it has its own fork now, or the request is gone)."""
    id: int


class Stop(msgspec.Struct, tag="stop"):
    pass


class Threads(msgspec.Struct, tag="threads"):
    """Run BLAS on ``n`` threads from the next step on: the supervisor lends
    the cores of idle workers to the busy ones (``core_shares``)."""
    n: int


ToWorker = Union[Gen, Cancel, Unpark, Stop, Threads]


# ----------------------------------------------------------- from a worker
class Ready(msgspec.Struct, tag="ready"):
    worker: int
    pid: int


class Admitted(msgspec.Struct, tag="admitted"):
    id: int
    prompt_tokens: int
    cached_tokens: int


class Progress(msgspec.Struct, tag="progress"):
    """A prefill's progress: the request's first ``stored`` prompt tokens are
    in the pool, their full blocks published (sent after the cached prefix
    is taken and after each chunk)."""
    id: int
    stored: int


class Handoff(msgspec.Struct, tag="handoff"):
    """A ``Gen(handoff=True)``'s prompt[:-1] is in the pool: its full blocks
    published and all of it in the table ``table``, kept until ``Unpark``;
    ``cached``: the tokens it found in the pool before computing."""
    id: int
    table: str
    stored: int
    cached: int


class Step(msgspec.Struct, tag="step"):
    """One decode step's tokens: (request id, sample, token, finish reason or
    "", the token's log probabilities when the request asked for them, else None)."""
    items: list[tuple[int, int, int, str, Optional[TokenLogprob]]]


class Failed(msgspec.Struct, tag="failed"):
    id: int
    message: str
    status: int = 500


class Load(msgspec.Struct, tag="load"):
    """A worker's counters, sent now and then."""
    worker: int
    running: int
    waiting: int
    preemptions: int
    working_bytes: int             # this worker's private K/V working buffers
    l2: dict[str, int] = {}        # the L2 tier's counters (shmcache.l2.COUNTERS, "up"), if any
    blas_threads: int = 0          # the threads its BLAS runs now (0: unknown)


FromWorker = Union[Ready, Admitted, Progress, Handoff, Step, Failed, Load]

_LEN = struct.Struct("<I")


class Writer:
    """Frames messages onto a file descriptor (thread-safe)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._enc = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()

    def send(self, msg) -> None:
        body = self._enc.encode(msg)
        data = _LEN.pack(len(body)) + body
        with self._lock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]


def read_frame(fd: int) -> Optional[bytes]:
    """One frame's body from a blocking descriptor; None at end of file."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    return body


def _read_exact(fd: int, n: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


to_worker = msgspec.msgpack.Decoder(ToWorker)
from_worker = msgspec.msgpack.Decoder(FromWorker)

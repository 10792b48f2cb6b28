"""The test side of the multi-process tests: start and drive workers.

``WorkerProc`` starts ``tests/_proc_server.py`` (an independent process, not
a fork of the test) and talks to it line by line, every wait with a
timeout. The helpers check what workers did: the payload a chain should
hold (``write_positions``/``verify_blocks``, the pattern of
``tools.stress.workload_payload``) and the pool lock as the kernel sees it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tools.stress.lockwatch import lock_waiters  # the kernel's view of who waits
from tools.stress.workload_payload import chain_mismatch, extra_for, write_chain

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_proc_server.py")


# ------------------------------------------------------------------ payload
def family_tokens(f: int, n: int) -> list:
    """``n`` token ids of chain family ``f`` (families share no prefix)."""
    return [(f * 1009 + i * 31) % 8000 + 1 for i in range(n)]


def write_positions(mgr, blocks, first_pos: int, tokens, salt: int) -> None:
    """Write the pattern of ``tokens[first_pos:]`` (the chain ``tokens``
    under ``salt``) into ``blocks``, where blocks[0] holds ``first_pos``."""
    ids = [getattr(b, "block_id", b) for b in blocks]
    write_chain(mgr, ids, tokens, extra_for(salt), first_pos, len(tokens),
                first_pos // mgr.block_size)


def verify_blocks(mgr, block_ids, tokens, salt: int, what: str) -> None:
    """Assert that the first len(tokens) positions of ``block_ids`` hold the chain's pattern."""
    bad = chain_mismatch(mgr, block_ids, tokens, extra_for(salt), len(tokens))
    if bad:
        raise AssertionError(f"payload mismatch in {what}: {bad} (salt {salt}, "
                             f"tokens {list(tokens[:8])}...)")


# ------------------------------------------------------------------ workers
class RemoteError(Exception):
    """A serve-mode command raised; ``kind`` is the exception's type name."""

    def __init__(self, reply: dict) -> None:
        super().__init__(f"{reply.get('error')}: {reply.get('msg')}\n{reply.get('tb', '')}")
        self.kind = reply.get("error")


class WorkerProc:
    """A worker started with ``subprocess.Popen`` (an independent process,
    not a fork of the test), with line-wise stdout read by a thread so that
    every wait has a timeout.

    Args:
        *args: the server's arguments (MODE NAME ...).
        env: variables added to the worker's environment.
    """

    def __init__(self, *args, env=None) -> None:
        self.args = [str(a) for a in args]
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, *self.args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, close_fds=True,
            env=None if env is None else {**os.environ, **env})
        self.pid = self.proc.pid
        self.lines: queue.Queue = queue.Queue()
        self.err: list = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put, True),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err.append, False),
                         daemon=True).start()
        self.slot = None

    @staticmethod
    def _pump(stream, put, eof_marker: bool) -> None:
        try:
            for line in stream:
                put(line.rstrip("\n"))
        except ValueError:
            pass
        if eof_marker:
            put(None)

    def stderr_text(self) -> str:
        return "\n".join(self.err[-60:])

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The rest of the next stdout line starting with ``prefix``.

        Raises:
            AssertionError: none came within ``timeout`` or the worker ended.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"worker {self.args} sent no {prefix!r} within {timeout}s; "
                                     f"stderr:\n{self.stderr_text()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.lines.put(None)
                time.sleep(0.05)   # let stderr drain into the message
                raise AssertionError(f"worker {self.args} ended (rc={self.proc.poll()}) before "
                                     f"{prefix!r}; stderr:\n{self.stderr_text()}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def ready(self, timeout: float = 30.0) -> int:
        self.slot = int(self.expect("READY", timeout))
        return self.slot

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def request(self, op: str, **kw) -> None:
        self.send(json.dumps({"op": op, **kw}))

    def call(self, op: str, timeout: float = 30.0, **kw):
        """Run one serve-mode command and return its result (RemoteError if it raised)."""
        self.request(op, **kw)
        return self.result(timeout)

    def result(self, timeout: float = 30.0):
        r = json.loads("{" + self.expect("{", timeout))
        if not r["ok"]:
            raise RemoteError(r)
        return r["result"]

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc.poll() is None


# --------------------------------------------------------------------- lock
def wait_for_lock_waiter(path: str, pid: int, timeout: float = 20.0) -> None:
    """Return once ``pid`` is blocked on the pool lock of ``path`` (a handshake through the kernel)."""
    deadline = time.monotonic() + timeout
    while pid not in lock_waiters(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} never blocked on the pool lock of {path}")
        time.sleep(0.005)


def lock_is_busy(path: str) -> bool:
    """Whether someone holds the pool lock of ``path`` (tried through a mapping of our own)."""
    import mmap
    from shmcache.shm.lock import MUTEX_MAP_SIZE, open_mutex
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, MUTEX_MAP_SIZE)
    finally:
        os.close(fd)
    m = open_mutex(mm)
    try:
        if m.trylock() < 0:
            return True
        m.unlock()
        return False
    finally:
        m.release()
        mm.close()

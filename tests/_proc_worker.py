#!/usr/bin/env python
"""A standalone process that attaches to a shmcache pool by name.

Run by the multi-process tests as ``python tests/_proc_worker.py MODE NAME ...``
through ``subprocess`` (never forked from the test process): each worker is an
independent process that finds the pool only by its name.

Modes:
  random NAME SEED DURATION
      Random allocate / cache / acquire / table / fork / append / free /
      delete work for DURATION seconds (or until stdin reaches EOF or reads
      "stop"), checking every payload it reads back. Prints ``READY <slot>``
      after attaching, waits for a ``go`` line on stdin, prints
      ``PROGRESS <n>`` every few operations, and at the end closes its
      manager and prints ``DONE <json summary>``. A payload mismatch or an
      unexpected exception exits with status 3.
  serve NAME
      Executes JSON commands read one per line from stdin and answers each
      with one JSON line (see ``Server``). Used for scripted scenarios:
      holding the pool lock, scribbling half an update, holding references
      when killed.

Payload pattern: the K/V of a token is derived from its id and the request's
salt only, so any process that finds a cached block for a token chain knows
the bytes the publisher wrote (``pattern``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import shmcache  # noqa: E402
from shmcache import layout as L  # noqa: E402
from shmcache.errors import OutOfBlocksError  # noqa: E402


# ----------------------------------------------------------------- payloads
def pattern(tokens, salt: int, heads: int, dim: int):
    """(keys, values) of shape (heads, len(tokens), dim), exact in float32."""
    t = np.asarray(tokens, dtype=np.float32)[None, :, None]
    h = np.arange(heads, dtype=np.float32)[:, None, None] * 0.5
    d = np.arange(dim, dtype=np.float32)[None, None, :] * 0.125
    k = t + salt * 20000.0 + h + d
    k = np.broadcast_to(k, (heads, len(tokens), dim)).astype(np.float32)
    return k, -k - 1.0


def family_tokens(f: int, n: int) -> list:
    return [(f * 1009 + i * 31) % 8000 + 1 for i in range(n)]


def extra_for(salt: int):
    return None if salt == 0 else ("tenant", salt)


def write_positions(mgr, blocks, first_pos: int, tokens, salt: int) -> None:
    """Write the pattern of ``tokens[first_pos:]`` into ``blocks``, where
    blocks[0] is the block holding position ``first_pos``."""
    bs = mgr.block_size
    lay = mgr.layout
    base = first_pos // bs
    pos = first_pos
    while pos < len(tokens):
        bi = pos // bs
        end = min(len(tokens), (bi + 1) * bs)
        k, v = pattern(tokens[pos:end], salt, lay.num_kv_heads, lay.head_dim)
        for layer in range(lay.num_layers):
            mgr.write_kv(blocks[bi - base].block_id, layer, k, v, start=pos % bs)
        pos = end


def verify_blocks(mgr, block_ids, tokens, salt: int, what: str) -> None:
    """The first len(tokens) positions of ``block_ids`` hold ``tokens``' pattern."""
    if not tokens:
        return
    lay = mgr.layout
    want_k, want_v = pattern(tokens, salt, lay.num_kv_heads, lay.head_dim)
    for layer in range(lay.num_layers):
        k, v = mgr.read_kv(list(block_ids), layer)
        k = np.array(k)[:, :len(tokens)]
        v = np.array(v)[:, :len(tokens)]
        if not (np.array_equal(k, want_k) and np.array_equal(v, want_v)):
            bad = np.flatnonzero((k != want_k).any(axis=(0, 2)))
            raise AssertionError(
                f"payload mismatch in {what}: blocks {list(block_ids)} layer {layer} "
                f"positions {bad[:8].tolist()} (salt {salt}, tokens {tokens[:8]}...)")


# ------------------------------------------------------------------ random
class RandomWorker:
    def __init__(self, mgr, seed: int) -> None:
        self.m = mgr
        self.rng = random.Random(seed)
        self.seed = seed
        self.bs = mgr.block_size
        self.loose: list = []          # block ids held outside tables
        self.tables: dict = {}         # rid -> {"tokens": [...], "salt": s}
        self.foreign: list = []        # forks of other processes' tables (content unknown)
        self.n = 0
        self.counts: dict = {}
        self.max_latency = 0.0
        self.verified_blocks = 0
        self.acquired_hits = 0

    def rid(self) -> str:
        self.n += 1
        return f"w{self.seed}-{os.getpid()}-{self.n}"

    def timed(self, fn, *a, **kw):
        t0 = time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.monotonic() - t0
            if dt > self.max_latency:
                self.max_latency = dt

    # --- operations
    def op_alloc(self):
        if len(self.loose) >= 8:
            return
        b = self.timed(self.m.allocate_block)
        if b is not None:
            assert b.ref_count >= 1
            self.loose.append(b.block_id)

    def op_get_new(self):
        if len(self.loose) >= 8:
            return
        try:
            bl = self.timed(self.m.get_new_blocks, self.rng.randint(1, 3))
        except OutOfBlocksError:
            return
        self.loose.extend(b.block_id for b in bl)

    def op_free(self):
        if not self.loose:
            return
        b = self.loose.pop(self.rng.randrange(len(self.loose)))
        self.timed(self.m.free_block, b)

    def op_free_batch(self):
        if not self.loose:
            return
        self.rng.shuffle(self.loose)
        k = self.rng.randint(1, len(self.loose))
        batch, self.loose = self.loose[:k], self.loose[k:]
        self.timed(self.m.free_block_batch, batch)

    def op_request(self):
        """A new request: acquire its cached prefix, fill the rest, publish."""
        if len(self.tables) >= 6:
            return
        m, bs = self.m, self.bs
        f = self.rng.randrange(4)
        salt = self.rng.randrange(3)
        extra = extra_for(salt)
        n_tok = self.rng.randint(1, 4 * bs + bs - 1)
        tokens = family_tokens(f, n_tok)
        blocks, n_cached_tok = self.timed(m.acquire_computed_blocks, tokens, extra)
        assert n_cached_tok == len(blocks) * bs
        nc = len(blocks)
        if nc:
            self.acquired_hits += nc
            verify_blocks(m, [b.block_id for b in blocks], tokens[:nc * bs], salt,
                          f"acquired prefix family {f} salt {salt}")
            self.verified_blocks += nc
        rid = self.rid()
        table = self.timed(m.create_block_table, rid)
        for b in blocks:
            self.timed(m.add_block_to_table, table, b, bs)
        rest = n_tok - nc * bs
        try:
            if rest and self.rng.random() < 0.5:
                out = self.timed(m.prepare_append, table, rest)
                write_positions(m, out, nc * bs, tokens, salt)
            elif rest:
                need = -(-rest // bs)
                new = self.timed(m.get_new_blocks, need)
                for i, b in enumerate(new):
                    lo = (nc + i) * bs
                    chunk = tokens[lo:lo + bs]
                    write_positions(m, [b], lo, tokens[:lo + len(chunk)], salt)
                    self.timed(m.add_block_to_table, table, b, len(chunk))
        except OutOfBlocksError:
            self.timed(m.delete_block_table, rid)
            return
        self.tables[rid] = {"tokens": tokens, "salt": salt}
        t = m.get_block_table(rid)
        assert t.num_tokens == n_tok, (t.num_tokens, n_tok)
        ids = t.block_ids
        assert len(ids) == -(-n_tok // bs)
        # K/V is written: publish the full blocks
        self.timed(m.cache_full_blocks, [m.blocks[i] for i in ids], tokens,
                   self.rng.choice([0, nc]), n_tok // bs, extra)

    def op_append(self):
        if not self.tables:
            return
        rid = self.rng.choice(sorted(self.tables))
        st = self.tables[rid]
        if len(st["tokens"]) > 8 * self.bs:
            return
        n = self.rng.randint(1, 2 * self.bs)
        new_tokens = [self.rng.randint(1, 8000) for _ in range(n)]
        before = len(st["tokens"])
        try:
            out = self.timed(self.m.prepare_append, rid, n)
        except OutOfBlocksError:
            return
        st["tokens"] = st["tokens"] + new_tokens
        write_positions(self.m, out, before, st["tokens"], st["salt"])
        if self.rng.random() < 0.3:
            ids = self.m.get_block_table(rid).block_ids
            self.timed(self.m.cache_full_blocks, [self.m.blocks[i] for i in ids], st["tokens"],
                       0, len(st["tokens"]) // self.bs, extra_for(st["salt"]))

    def op_fork(self):
        if not self.tables or len(self.tables) >= 6:
            return
        src = self.rng.choice(sorted(self.tables))
        dst = self.rid()
        self.timed(self.m.fork_block_table, src, dst)
        self.tables[dst] = dict(self.tables[src])

    def op_foreign_fork(self):
        """Fork another process's table, append to it (COW) and write junk into
        the copy; the owner's own verification catches a shared payload."""
        if len(self.foreign) >= 2:
            return
        others = [r for r in self.m.request_tables if r not in self.tables and r not in self.foreign]
        if not others:
            return
        src = self.rng.choice(others)
        dst = self.rid()
        try:
            t = self.timed(self.m.fork_block_table, src, dst)
        except KeyError:
            return          # its owner deleted it meanwhile
        self.foreign.append(dst)
        before = t.num_tokens
        n = self.rng.randint(1, self.bs)
        try:
            out = self.timed(self.m.prepare_append, dst, n)
        except OutOfBlocksError:
            return
        junk = [7777] * (before + n)
        write_positions(self.m, out, before, junk, 2)

    def op_delete(self):
        pool = sorted(self.tables) + self.foreign
        if not pool:
            return
        rid = self.rng.choice(pool)
        self.timed(self.m.delete_block_table, rid)
        self.tables.pop(rid, None)
        if rid in self.foreign:
            self.foreign.remove(rid)

    def op_verify(self):
        if self.tables:
            self.verify_table(self.rng.choice(sorted(self.tables)))

    def verify_table(self, rid: str) -> None:
        st = self.tables[rid]
        t = self.m.get_block_table(rid)
        assert t is not None, f"my table {rid} vanished"
        assert t.num_tokens == len(st["tokens"]), (rid, t.num_tokens, len(st["tokens"]))
        ids = t.block_ids
        verify_blocks(self.m, ids, st["tokens"], st["salt"], f"own table {rid}")
        self.verified_blocks += len(ids)

    def op_lookup_touch(self):
        """get_computed_blocks then touch: racy by design, but safe."""
        if len(self.loose) >= 8:
            return
        f = self.rng.randrange(4)
        salt = self.rng.randrange(3)
        blocks, _ = self.timed(self.m.get_computed_blocks, family_tokens(f, 3 * self.bs),
                               extra_for(salt))
        if blocks:
            b = blocks[0]
            self.timed(self.m.touch, [b])
            self.loose.append(b.block_id)

    def op_stats(self):
        s = self.timed(self.m.get_stats)
        assert s.allocated_blocks + s.free_blocks == s.total_blocks, s
        assert 0 <= s.free_blocks < s.total_blocks

    def op_check(self):
        problems = self.timed(self.m.check)
        assert problems == [], problems

    OPS = [("alloc", 6), ("get_new", 4), ("free", 6), ("free_batch", 3), ("request", 12),
           ("append", 8), ("fork", 4), ("foreign_fork", 2), ("delete", 6), ("verify", 6),
           ("lookup_touch", 2), ("stats", 2), ("check", 1)]

    def step(self) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        name = self.rng.choices(names, weights)[0]
        getattr(self, "op_" + name)()
        self.counts[name] = self.counts.get(name, 0) + 1

    def finish(self) -> None:
        """Either release everything explicitly or leave it to close()."""
        if self.rng.random() < 0.5:
            for rid in sorted(self.tables) + self.foreign:
                if rid in self.tables:
                    self.verify_table(rid)
                self.m.delete_block_table(rid)
            if self.loose:
                self.m.free_block_batch(self.loose)
            self.tables, self.foreign, self.loose = {}, [], []
            return "explicit"
        return "close"


def _stdin_watcher(stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


def run_random(name: str, seed: int, duration: float) -> int:
    mgr = shmcache.attach(name)
    print(f"READY {mgr._p.slot}", flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        mgr.close()
        return 0
    stop = threading.Event()
    threading.Thread(target=_stdin_watcher, args=(stop,), daemon=True).start()
    w = RandomWorker(mgr, seed)
    deadline = time.monotonic() + duration
    steps = 0
    try:
        while time.monotonic() < deadline and not stop.is_set():
            w.step()
            steps += 1
            if steps % 20 == 0:
                print(f"PROGRESS {steps}", flush=True)
        how = w.finish()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    mgr.close()
    print("DONE " + json.dumps({"steps": steps, "counts": w.counts, "finish": how,
                                "max_latency": w.max_latency,
                                "verified_blocks": w.verified_blocks,
                                "acquired_hits": w.acquired_hits, "pid": os.getpid()}),
          flush=True)
    return 0


# ------------------------------------------------------------------- serve
SCRIBBLES = ("pop_free", "half_unlink", "ref_chunk", "table_half", "release_half")


class Server:
    """JSON-lines command server over one attached manager."""

    def __init__(self, mgr) -> None:
        self.m = mgr
        self.p = mgr._p

    def blocks(self, ids):
        return [self.m.blocks[int(i)] for i in ids]

    def cmd_alloc(self, n):
        return [b.block_id for b in self.m.get_new_blocks(n)]

    def cmd_free(self, ids):
        self.m.free_block_batch(list(ids))

    def cmd_create(self, rid):
        self.m.create_block_table(rid)

    def cmd_add(self, rid, block, tokens):
        self.m.add_block_to_table(rid, self.m.blocks[block], tokens)

    def cmd_fork(self, src, dst):
        return self.m.fork_block_table(src, dst).block_ids

    def cmd_delete(self, rid):
        self.m.delete_block_table(rid)

    def cmd_table(self, rid):
        t = self.m.get_block_table(rid)
        return None if t is None else {"block_ids": t.block_ids, "num_tokens": t.num_tokens}

    def cmd_tables(self):
        return sorted(self.m.request_tables)

    def cmd_stats(self):
        s = self.m.get_stats()
        return {k: getattr(s, k) for k in ("total_blocks", "allocated_blocks", "free_blocks",
                                            "shared_blocks", "total_tokens_cached", "cache_hits",
                                            "cache_misses", "cow_copies", "evictions")}

    def cmd_write(self, block, tokens, salt, start=0):
        lay = self.m.layout
        k, v = pattern(tokens, salt, lay.num_kv_heads, lay.head_dim)
        for layer in range(lay.num_layers):
            self.m.write_kv(block, layer, k, v, start=start)

    def cmd_verify(self, ids, tokens, salt):
        verify_blocks(self.m, ids, tokens, salt, "serve verify")
        return True

    def cmd_cache(self, rid, tokens, salt, num_cached=0):
        ids = self.m.get_block_table(rid).block_ids
        self.m.cache_full_blocks(self.blocks(ids), tokens, num_cached,
                                 len(tokens) // self.m.block_size, extra_for(salt))

    def cmd_acquire(self, tokens, salt):
        bl, n = self.m.acquire_computed_blocks(tokens, extra_for(salt))
        return [[b.block_id for b in bl], n]

    def cmd_prepare_append(self, rid, n):
        return [b.block_id for b in self.m.prepare_append(rid, n)]

    def cmd_holdings(self):
        return self.m.holdings()

    def cmd_check(self):
        return self.m.check()

    def cmd_reclaim(self):
        return self.m.reclaim_dead()

    def cmd_slot(self):
        return self.p.slot

    def cmd_native(self):
        return type(self.p.native).__name__

    def cmd_lock_enter(self):
        self.p.lock.__enter__()
        return self.p.lock.held

    def cmd_lock_exit(self):
        self.p.lock.__exit__(None, None, None)

    def cmd_append_file(self, path, line):
        with open(path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def cmd_scribble(self, kind):
        """Enter the lock and leave half an update behind (the caller kills us)."""
        p, m = self.p, self.m
        p.lock.__enter__()
        assert p.c[L.C_DIRTY] == 1
        nxt, prv = p.b_next, p.b_prev
        if kind == "pop_free":
            # unlink a block from the free list without recording it anywhere
            b = m._fq.popleft_id()
            p.b_ref[b] = 1
            return b
        if kind == "half_unlink":
            # the first half of remove_id on a block in the middle of the list
            b = m._fq.ids()[2]
            pr, n = prv[b], nxt[b]
            nxt[pr] = n
            p.c[L.C_NUM_FREE] -= 1
            return b
        if kind == "ref_chunk":
            # take a chunk, write a held block into it and bump the block's
            # count, die before linking the chunk anywhere
            b = next(iter(m._refs.loose))
            c = m._refs._new_chunk()
            p.kw[c * L.CHUNK_WORDS + 1] = b
            p.b_ref[b] += 1
            return b
        if kind == "table_half":
            # a table half created, and a live table's append cut short after
            # linking a new tail chunk (its length, the commit, not bumped)
            t = m._new_table("half-made")
            p.t_state[t] = 0
            t2 = m._table_index(m.get_block_table("victim"))
            c = m._refs._new_chunk()
            p.kw[p.t_tail[t2] * L.CHUNK_WORDS] = c
            p.t_tail[t2] = c
            b = m._fq.popleft_id()
            p.b_ref[b] = 1
            p.kw[c * L.CHUNK_WORDS + 1] = b
            return t
        if kind == "release_half":
            # a table's block released in the free list while its id stays
            t = m._table_index(m.get_block_table("victim"))
            b = p.kw[p.t_head[t] * L.CHUNK_WORDS + 1]
            p.b_ref[b] = 0
            m._fq.append_id(b)
            return b
        raise ValueError(kind)

    def cmd_close(self):
        self.m.close()

    def cmd_exit(self):
        print(json.dumps({"ok": True, "result": None}), flush=True)
        os._exit(0)

    def cmd_pid(self):
        return os.getpid()


def run_serve(name: str) -> int:
    mgr = shmcache.attach(name)
    srv = Server(mgr)
    print(f"READY {mgr._p.slot}", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        op = req.pop("op")
        try:
            res = getattr(srv, "cmd_" + op)(**req)
            out = {"ok": True, "result": res}
        except Exception as e:  # reported to the test, which decides
            out = {"ok": False, "error": type(e).__name__, "msg": str(e),
                   "tb": traceback.format_exc()}
        print(json.dumps(out, default=int), flush=True)
    if not mgr._p.closed:
        mgr.close()
    return 0


def main(argv) -> int:
    mode, name = argv[1], argv[2]
    if mode == "random":
        return run_random(name, int(argv[3]), float(argv[4]))
    if mode == "serve":
        return run_serve(name)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))


# ============================================================ parent side
# The tests import this module for the helpers below; nothing above runs on import.

class RemoteError(Exception):
    def __init__(self, reply: dict) -> None:
        super().__init__(f"{reply.get('error')}: {reply.get('msg')}\n{reply.get('tb', '')}")
        self.kind = reply.get("error")


class WorkerProc:
    """A worker started with ``subprocess.Popen`` (an independent process,
    not a fork of the test), with line-wise stdout read by a thread so that
    every wait has a timeout."""

    def __init__(self, *args, env=None) -> None:
        import queue
        import subprocess
        self.args = [str(a) for a in args]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *self.args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, close_fds=True,
            env=None if env is None else {**os.environ, **env})
        self.pid = self.proc.pid
        self.lines: "queue.Queue" = queue.Queue()
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
        """The rest of the next stdout line starting with ``prefix``."""
        import queue
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
        import signal
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc.poll() is None


from tools.lockwatch import lock_waiters  # noqa: E402  (the kernel's view of who waits)


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
    from shmcache.mutex import MUTEX_MAP_SIZE, open_mutex
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

#!/usr/bin/env python
"""A standalone worker process that attaches to a shmcache pool by name.

Started by the multi-process tests through ``_proc_client.WorkerProc`` as
``python tests/_proc_server.py MODE NAME ...`` with ``subprocess`` (never
forked from the test process): each worker is an independent process that
finds the pool only by its name.

Modes:
  random NAME SEED DURATION [DEMAND]
      The random workload of ``tools.stress.workload_driver`` (strict: the first
      payload mismatch, violated invariant or leak raises) for DURATION
      seconds, or until stdin reaches EOF or reads "stop", holding at most
      DEMAND blocks (default: a fifth of the pool). Prints ``READY <slot>``
      after attaching, waits for a ``go`` line on stdin, prints
      ``PROGRESS <n>`` every 20 operations, and at the end either releases
      everything itself or leaves it to close(), closes its manager and
      prints ``DONE <json summary>``. An exception exits with status 3.
  serve NAME
      Executes JSON commands read one per line from stdin and answers each
      with one JSON line (see ``Server``). Used for scripted scenarios:
      holding the pool lock, scribbling half an update, holding references
      when killed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import shmcache  # noqa: E402
from shmcache.shm import layout as L  # noqa: E402
from tools.stress.workload_driver import Workload  # noqa: E402
from tools.stress.workload_payload import chain_mismatch, extra_for, write_chain  # noqa: E402

# what cmd_scribble can leave half done under the lock
SCRIBBLES = ("pop_free", "half_unlink", "ref_chunk", "table_half", "release_half")


# ------------------------------------------------------------------ random
def _stdin_watcher(stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


def run_random(name: str, seed: int, duration: float, demand: int = 0) -> int:
    mgr = shmcache.attach(name)
    print(f"READY {mgr.pool.slot}", flush=True)
    if sys.stdin.readline().strip() != "go":
        mgr.close()
        return 0
    stop = threading.Event()
    threading.Thread(target=_stdin_watcher, args=(stop,), daemon=True).start()
    w = Workload(mgr, seed, demand or max(8, (mgr.max_blocks - 1) // 5), strict=True)
    deadline = time.monotonic() + duration
    steps = 0
    try:
        while time.monotonic() < deadline and not stop.is_set():
            w.step()
            steps += 1
            if steps % 20 == 0:
                print(f"PROGRESS {steps}", flush=True)
        # either release everything explicitly or leave it to close()
        how = "explicit" if w.rng.random() < 0.5 else "close"
        if how == "explicit":
            w.release()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    mgr.close()
    print("DONE " + json.dumps({"steps": steps, "counts": w.r["counts"], "finish": how,
                                "max_latency": w.r["max_latency"],
                                "verified_blocks": w.r["verified_blocks"],
                                "acquired_hits": w.r["acquired_hits"], "pid": os.getpid()}),
          flush=True)
    return 0


# ------------------------------------------------------------------- serve
class Server:
    """JSON-lines command server over one attached manager: ``cmd_<op>``
    runs for a line ``{"op": "<op>", ...}`` with the other keys as arguments."""

    def __init__(self, mgr) -> None:
        self.m = mgr
        self.p = mgr.pool

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

    def cmd_write(self, block, tokens, salt, start):
        """Write positions [start, len(tokens)) of the chain ``tokens`` into
        ``block``, the block holding position ``start``."""
        bs = self.m.block_size
        write_chain(self.m, [block], tokens, extra_for(salt), start, len(tokens), start // bs)

    def cmd_verify(self, ids, tokens, salt):
        bad = chain_mismatch(self.m, ids, tokens, extra_for(salt), len(tokens))
        if bad:
            raise AssertionError(f"payload mismatch in serve verify: {bad}")
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
            b = m.internals.ledger.free_queue.popleft_id()
            p.b_ref[b] = 1
            return b
        if kind == "half_unlink":
            # the first half of remove_id on a block in the middle of the list
            b = m.internals.ledger.free_queue.ids()[2]
            pr, n = prv[b], nxt[b]
            nxt[pr] = n
            p.c[L.C_NUM_FREE] -= 1
            return b
        if kind == "ref_chunk":
            # take a chunk, write a held block into it and bump the block's
            # count, die before linking the chunk anywhere
            b = m.internals.holder.refs.loose.blocks()[0]
            c = m.internals.holder.refs._new_chunk()
            p.kw[c * L.CHUNK_WORDS + 1] = b
            p.b_ref[b] += 1
            return b
        if kind == "table_half":
            # a table half created, and a live table's append cut short after
            # linking a new tail chunk (its length, the commit, not bumped)
            t = m.internals.tables.new_table("half-made")
            p.t_state[t] = 0
            t2 = m.internals.tables.table_index(m.get_block_table("victim"))
            c = m.internals.holder.refs._new_chunk()
            p.kw[p.t_tail[t2] * L.CHUNK_WORDS] = c
            p.t_tail[t2] = c
            b = m.internals.ledger.free_queue.popleft_id()
            p.b_ref[b] = 1
            p.kw[c * L.CHUNK_WORDS + 1] = b
            return t
        if kind == "release_half":
            # a table's block released in the free list while its id stays
            t = m.internals.tables.table_index(m.get_block_table("victim"))
            b = p.kw[p.t_head[t] * L.CHUNK_WORDS + 1]
            p.b_ref[b] = 0
            m.internals.ledger.free_queue.append_id(b)
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
    print(f"READY {mgr.pool.slot}", flush=True)
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
    if not mgr.pool.closed:
        mgr.close()
    return 0


def main(argv) -> int:
    mode, name = argv[1], argv[2]
    if mode == "random":
        return run_random(name, int(argv[3]), float(argv[4]),
                          int(argv[5]) if len(argv) > 5 else 0)
    if mode == "serve":
        return run_serve(name)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))

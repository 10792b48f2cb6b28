"""The per-process side of ``python -m tools.stress``: one stress worker.

Each worker process (started by the runner in :mod:`tools.stress` as
``python -m tools.stress --worker NAME ...``) attaches to the pool by name
and runs a random mix of the whole API, bounded by its demand, checking
every block it reads back against the payload pattern its writer (or
publisher) wrote, and reports progress, peak RSS/PSS and any mismatch,
violation or error through its result file. See :mod:`tools.stress` for the
payload patterns and the whole run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
import traceback

import numpy as np
import psutil

M24 = 1 << 24                 # payload values are integers < 2**24: exact in float32
VOCAB = 50000
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16
MAX_TABLE_BLOCKS = 12
EXIT_ATTACH_FULL = 3


# ================================================================= payloads
def _key(*parts) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % M24


class Pattern:
    """Expected K/V contents (float32 integers), shared by writers and readers."""

    def __init__(self, bs: int) -> None:
        self.bs = bs
        n = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM
        self.off = (np.arange(n, dtype=np.int64) * 65537 % M24).reshape(
            NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM)

    def chain_keys(self, tokens, extra) -> list:
        """One key per block, from the chain of token ids before it."""
        h = hashlib.blake2b(repr(extra).encode(), digest_size=16).digest()
        out = []
        for i in range(-(-len(tokens) // self.bs)):
            out.append(int.from_bytes(h[:8], "little") % M24)
            blk = np.asarray(tokens[i * self.bs:(i + 1) * self.bs], dtype="<u4").tobytes()
            h = hashlib.blake2b(h + blk, digest_size=16).digest()
        return out

    def table_seeds(self, tokens, extra, a: int, b: int) -> np.ndarray:
        """Per-position seeds of positions [a, b): the chain before the
        position's block, the token there and its offset in the block."""
        keys = np.asarray(self.chain_keys(tokens[:b], extra), dtype=np.int64)
        pos = np.arange(a, b)
        tok = np.asarray(tokens[a:b], dtype=np.int64)
        return (keys[pos // self.bs] + tok * 40503 + (pos % self.bs) * 9973) % M24

    def private_seeds(self, key: int) -> np.ndarray:
        return (key + np.arange(self.bs, dtype=np.int64) * 40503) % M24

    def arrays(self, seeds: np.ndarray, layer: int):
        """(K, V) as float32 numpy arrays (H, len(seeds), D)."""
        o = self.off[layer]
        k = (seeds[None, :, None] + o[0][:, None, :]) % M24
        v = (seeds[None, :, None] + o[1][:, None, :]) % M24
        return k.astype(np.float32), v.astype(np.float32)


# ================================================================== worker
class Worker:
    def __init__(self, args) -> None:
        import shmcache
        from shmcache import OutOfBlocksError, CapacityError
        self.E_OOB, self.E_CAP = OutOfBlocksError, CapacityError
        self.rng = random.Random(args.seed)
        self.result_path = args.result
        self.parent = args.parent
        self.demand = args.demand
        self.stop = False
        try:
            self.m = shmcache.attach(args.worker)
        except CapacityError:
            sys.exit(EXIT_ATTACH_FULL)
        self.waits = self.m._p.lock.wait_log = []     # waits for the pool lock, ns
        self.waits_dropped = 0
        self.bs = self.m.block_size
        self.pat = Pattern(self.bs)
        self.pid = os.getpid()
        pr = random.Random(args.prompt_seed)
        roots = [[pr.randrange(VOCAB) for _ in range(2 * self.bs)] for _ in range(4)]
        self.prompts = [pr.choice(roots) + [pr.randrange(VOCAB) for _ in range(
            pr.randrange(0, 3 * self.bs + 1))] for _ in range(12)]
        self.tables = {}       # rid -> [tokens, extra, published_blocks]
        self.private = {}      # block id -> [key, references held]
        self.counter = 0
        self.r = dict(pid=self.pid, ops=0, out_of_blocks=0, capacity_errors=0,
                      payload_mismatches=0, mismatch_details=[], violations=0,
                      violation_details=[], verified_blocks=0, peak_rss_bytes=0,
                      peak_pss_bytes=0, self_leaks=0, done=False, error=None)
        self.proc = psutil.Process()
        self.last_flush = 0.0

    # ---------------------------------------------------------- reporting
    def flush(self, force=False) -> None:
        now = time.monotonic()
        if not force and now - self.last_flush < 0.25:
            return
        self.last_flush = now
        try:
            mi = self.proc.memory_full_info()
            self.r["peak_rss_bytes"] = max(self.r["peak_rss_bytes"], mi.rss)
            self.r["peak_pss_bytes"] = max(self.r["peak_pss_bytes"], getattr(mi, "pss", 0))
        except psutil.Error:
            pass
        # the count of waits and the slowest 1,024 are enough for a p99 of
        # up to ~100k waits per process
        if len(self.waits) > 2048:
            self.waits.sort()
            self.waits_dropped += len(self.waits) - 1024
            del self.waits[:-1024]
        self.r["lock_waits"] = self.waits_dropped + len(self.waits)
        self.r["lock_waits_top_ns"] = sorted(self.waits)[-1024:]
        tmp = self.result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.r, f)
        os.replace(tmp, self.result_path)
        if os.getppid() != self.parent:
            self.stop = True           # orphaned: the parent died

    def mismatch(self, what: str) -> None:
        self.r["payload_mismatches"] += 1
        if len(self.r["mismatch_details"]) < 5:
            self.r["mismatch_details"].append(what)
        self.flush(force=True)

    def call(self, fn, *a, **kw):
        self.r["ops"] += 1
        return fn(*a, **kw)

    # ------------------------------------------------------------ payload
    def held(self) -> int:
        return (sum(-(-len(t[0]) // self.bs) for t in self.tables.values())
                + sum(v[1] for v in self.private.values()))

    def write_table(self, rid, ids, a: int, b: int) -> None:
        """Write positions [a, b) of table ``rid`` whose blocks are ``ids`` (all blocks)."""
        tokens, extra, _ = self.tables[rid]
        seeds = self.pat.table_seeds(tokens, extra, a, b)
        import mlx.core as mx
        for layer in range(NUM_LAYERS):
            k, v = self.pat.arrays(seeds, layer)
            p = a
            while p < b:
                i, j = divmod(p, self.bs)
                e = min(b, (i + 1) * self.bs)
                s = slice(p - a, e - a)
                self.call(self.m.write_kv, ids[i], layer, mx.array(k[:, s, :]),
                          mx.array(v[:, s, :]), start=j)
                p = e

    def verify_chain(self, what, ids, tokens, extra, n: int) -> None:
        if n <= 0:
            return
        layer = self.rng.randrange(NUM_LAYERS)
        ids = ids[:-(-n // self.bs)]
        k, v = self.call(self.m.read_kv, ids, layer)
        k, v = np.array(k)[:, :n, :], np.array(v)[:, :n, :]
        ek, ev = self.pat.arrays(self.pat.table_seeds(tokens, extra, 0, n), layer)
        self.r["verified_blocks"] += len(ids)
        bad = np.flatnonzero(((k != ek) | (v != ev)).any(axis=(0, 2)))
        if bad.size:
            pos = int(bad[0])
            self.mismatch(f"{what}: block {ids[pos // self.bs]} (index {pos // self.bs}) "
                          f"position {pos % self.bs} layer {layer}: {bad.size} tokens differ")

    def write_private(self, b: int) -> None:
        import mlx.core as mx
        self.counter += 1
        key = _key(self.pid, b, self.counter)
        self.private[b] = [key, 1]
        seeds = self.pat.private_seeds(key)
        for layer in range(NUM_LAYERS):
            k, v = self.pat.arrays(seeds, layer)
            self.call(self.m.write_kv, b, layer, mx.array(k), mx.array(v))

    def verify_private(self, b: int) -> None:
        layer = self.rng.randrange(NUM_LAYERS)
        k, v = self.call(self.m.read_kv, [b], layer)
        ek, ev = self.pat.arrays(self.pat.private_seeds(self.private[b][0]), layer)
        self.r["verified_blocks"] += 1
        if not (np.array_equal(np.array(k), ek) and np.array_equal(np.array(v), ev)):
            self.mismatch(f"private block {b} layer {layer} does not hold its writer's bytes")

    # ----------------------------------------------------------- requests
    def new_rid(self) -> str:
        self.counter += 1
        return f"w{self.pid}-{self.counter}"

    def op_request(self) -> None:
        prompt = self.rng.choice(self.prompts)
        tokens = prompt + [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(2 * self.bs))]
        extra = self.rng.choice([None, None, ("tenant", 1)])
        need = -(-len(tokens) // self.bs)
        self.make_room(need)
        if self.held() + need > self.demand:
            return
        blocks, ncached = self.call(self.m.acquire_computed_blocks, tokens, extra)
        ids = [b.block_id for b in blocks]
        self.verify_chain("acquired prefix", ids, tokens, extra, ncached)
        rid = self.new_rid()
        try:
            t = self.call(self.m.create_block_table, rid)
        except self.E_CAP:
            self.r["capacity_errors"] += 1
            self.call(self.m.free_block_batch, ids)
            return
        self.tables[rid] = [tokens[:ncached], extra, len(ids)]
        for b in ids:
            self.call(self.m.add_block_to_table, t, b, self.bs)
        self.append(rid, tokens[ncached:])

    def append(self, rid, new_tokens) -> None:
        rec = self.tables[rid]
        n0 = len(rec[0])
        try:
            if self.rng.random() < 0.2:
                self.call(self.m.can_append, rid, len(new_tokens))
            self.call(self.m.prepare_append, rid, len(new_tokens))
        except self.E_CAP:          # (an OutOfBlocksError too: caught first)
            self.r["capacity_errors"] += 1
            return
        except self.E_OOB:
            self.r["out_of_blocks"] += 1
            if self.rng.random() < 0.5:
                self.op_delete()
            return
        rec[0] = rec[0] + list(new_tokens)
        ids = self.call(self.m.get_block_table, rid).block_ids
        self.write_table(rid, ids, n0, len(rec[0]))
        full = len(rec[0]) // self.bs
        if full > rec[2] and self.rng.random() < 0.7:
            self.call(self.m.cache_full_blocks, ids, rec[0], rec[2], full, rec[1])
            rec[2] = full

    def own_table(self):
        return self.rng.choice(sorted(self.tables)) if self.tables else None

    def op_decode(self) -> None:
        rid = self.own_table()
        if rid is None or len(self.tables[rid][0]) >= MAX_TABLE_BLOCKS * self.bs:
            return self.op_request()
        k = self.rng.randint(1, self.bs + 2)
        if self.held() + 2 > self.demand:
            self.make_room(2)
            if rid not in self.tables:
                return
        self.append(rid, [self.rng.randrange(VOCAB) for _ in range(k)])

    def op_fork(self) -> None:
        rid = self.own_table()
        if rid is None:
            return
        tokens, extra, pub = self.tables[rid]
        if self.held() + -(-len(tokens) // self.bs) > self.demand:
            return self.make_room(1)
        new = self.new_rid()
        try:
            self.call(self.m.fork_block_table, rid, new)
        except self.E_CAP:
            self.r["capacity_errors"] += 1
            return
        self.tables[new] = [list(tokens), extra, pub]

    def op_verify(self) -> None:
        rid = self.own_table()
        if rid is not None:
            tokens, extra, _ = self.tables[rid]
            ids = self.call(self.m.get_block_table, rid).block_ids
            self.verify_chain(f"table {rid}", ids, tokens, extra, len(tokens))

    def op_delete(self) -> None:
        rid = self.own_table()
        if rid is None:
            return
        if self.rng.random() < 0.3:
            self.op_verify()
        self.call(self.m.delete_block_table, rid)
        del self.tables[rid]

    def make_room(self, need: int) -> None:
        while self.held() + need > self.demand and (self.tables or self.private):
            if self.private and (not self.tables or self.rng.random() < 0.5):
                self.op_free()
            else:
                self.op_delete()

    # ------------------------------------------------------ private blocks
    def op_alloc(self) -> None:
        k = self.rng.randint(1, 3)
        if self.held() + k > self.demand:
            return self.make_room(k)
        try:
            if k == 1:
                b = self.call(self.m.allocate_block)
                if b is None:
                    self.r["out_of_blocks"] += 1
                    return
                blocks = [b]
            else:
                blocks = self.call(self.m.get_new_blocks, k)
        except self.E_CAP:          # (an OutOfBlocksError too: caught first)
            self.r["capacity_errors"] += 1
            return
        except self.E_OOB:
            self.r["out_of_blocks"] += 1
            return
        for b in blocks:
            self.write_private(b.block_id)

    def op_free(self) -> None:
        if not self.private:
            return
        ids = self.rng.sample(sorted(self.private), min(len(self.private), self.rng.randint(1, 3)))
        for b in ids:
            self.verify_private(b)
        if len(ids) == 1 and self.private[ids[0]][1] == 1:
            self.call(self.m.free_block, ids[0])
        else:
            self.call(self.m.free_block_batch, [b for b in ids for _ in range(self.private[b][1])])
        for b in ids:
            del self.private[b]

    def op_touch(self) -> None:
        if self.private and self.held() < self.demand:
            b = self.rng.choice(sorted(self.private))
            try:
                self.call(self.m.touch, [b])
            except self.E_CAP:
                self.r["capacity_errors"] += 1
                return
            self.private[b][1] += 1

    # ------------------------------------------------------------- others
    def op_acquire(self) -> None:
        tokens = self.rng.choice(self.prompts)
        extra = self.rng.choice([None, ("tenant", 1)])
        try:
            blocks, n = self.call(self.m.acquire_computed_blocks, tokens, extra)
        except self.E_CAP:
            self.r["capacity_errors"] += 1
            return
        ids = [b.block_id for b in blocks]
        self.verify_chain("acquired prompt", ids, tokens, extra, n)
        if ids:
            self.call(self.m.free_block_batch, ids)

    def op_lookup(self) -> None:
        self.call(self.m.get_computed_blocks, self.rng.choice(self.prompts))
        self.call(self.rng.choice([self.m.get_stats, self.m.get_memory_usage]))

    def op_evict(self) -> None:
        self.call(self.m.evict_lru_blocks, self.rng.randint(1, 4))

    def op_check(self) -> None:
        problems = self.call(self.m.check)
        if problems:
            self.r["violations"] += len(problems)
            self.r["violation_details"] = (self.r["violation_details"] + problems)[:10]
            self.flush(force=True)

    OPS = [("op_request", 22), ("op_decode", 26), ("op_fork", 7), ("op_verify", 10),
           ("op_delete", 10), ("op_alloc", 8), ("op_free", 7), ("op_touch", 2),
           ("op_acquire", 5), ("op_lookup", 2), ("op_evict", 1), ("op_check", 0.3)]

    def run(self) -> None:
        names, weights = zip(*self.OPS)
        while not self.stop:
            op = self.rng.choices(names, weights)[0]
            if op in ("op_delete", "op_free") and self.rng.random() * self.demand > self.held():
                op = "op_decode"     # grow towards the demand; release mostly under pressure
            getattr(self, op)()
            self.flush()
        self.release()

    def release(self) -> None:
        for rid in sorted(self.tables):
            tokens, extra, _ = self.tables[rid]
            ids = self.call(self.m.get_block_table, rid).block_ids
            self.verify_chain(f"table {rid}", ids, tokens, extra, len(tokens))
            self.call(self.m.delete_block_table, rid)
        self.tables.clear()
        for b in sorted(self.private):
            self.verify_private(b)
        if self.private:
            self.call(self.m.free_block_batch,
                      [b for b, (_, n) in self.private.items() for _ in range(n)])
        self.private.clear()
        mine = [h for h in self.m.holdings() if h["slot"] == self.m._p.slot]
        if mine and (mine[0]["tables"] or mine[0]["table_blocks"] or mine[0]["loose_blocks"]):
            self.r["self_leaks"] += 1
        self.m.close()
        self.r["done"] = True
        self.flush(force=True)


def worker_main(args) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent handles Ctrl-C
    import logging   # allocation failures are expected here, and counted
    logging.getLogger("shmcache.paged_cache").addFilter(
        lambda rec: "Out of cache blocks" not in rec.getMessage())
    w = None
    try:
        w = Worker(args)
        signal.signal(signal.SIGTERM, lambda *a: setattr(w, "stop", True))
        w.run()
        return 0
    except SystemExit:
        raise
    except BaseException:
        if w is not None:
            w.r["error"] = traceback.format_exc()[-2000:]
            w.flush(force=True)
        else:
            traceback.print_exc()
        return 1


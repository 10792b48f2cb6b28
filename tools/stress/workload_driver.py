"""One random workload over a shared pool, checking every payload it reads.

The driver of the stress tool's workers (:mod:`tools.stress.worker`) and of
the tests' random workers (``tests/_proc_server.py random``): a weighted
random mix of the whole API holding at most ``demand`` blocks. Every block
read back is compared with what its writer wrote (see
:mod:`tools.stress.workload_payload`); a wrong byte, a violated invariant or a leak
is recorded in ``r``, and with ``strict`` also raised as an AssertionError.

``Workload`` is one object that owns all of it: what it holds (``tables``,
``foreign``, ``private``), the bookkeeping (``call``/``attempt``/``failed``:
one API call, counted, a refusal for lack of room; ``problem``: a mismatch
or violation), the payload writes and checks, the operations of ``OPS``
(the weighted mix: one ``op_<name>`` method per entry: requests that
acquire a cached prefix and grow their table, decode steps, forks of our
own and of other processes' tables, deletes, private blocks allocated,
touched and freed, lookups, statistics, evictions, whole-pool checks) and
the driving (``step``, ``release``).
"""

from __future__ import annotations

import os
import random
import time

from shmcache.errors import CapacityError, OutOfBlocksError
from tools.stress import workload_payload as P

VOCAB = 50000
MAX_TABLE_BLOCKS = 12
MAX_FOREIGN = 2
SALTS = (0, 0, 1)          # most requests without extra keys, some of tenant 1
REFUSED = object()         # what ``Workload.attempt`` returns for a refusal for lack of room

# (operation, weight): op_<name> runs it
OPS = [("request", 22), ("append", 26), ("fork", 7), ("foreign_fork", 2), ("verify", 10),
       ("delete", 10), ("alloc", 4), ("get_new", 4), ("free", 4), ("free_batch", 3),
       ("touch", 2), ("acquire", 5), ("lookup", 2), ("stats", 1), ("evict", 1), ("check", 0.3)]


class Workload:
    """A random mix of the API by one manager, bounded by ``demand`` blocks.

    Args:
        mgr: an attached manager of a float32 pool.
        seed: seeds this workload's choices.
        demand: the most blocks it holds at once (it releases to stay under).
        prompt_seed: seeds the prompts; workloads with the same one share prefixes.
        strict: raise AssertionError at the first mismatch, violation or leak.
        convert: applied to each array written (e.g. ``mx.array``); None: numpy.
    """

    def __init__(self, mgr, seed: int, demand: int, prompt_seed: int = 0,
                 strict: bool = False, convert=None) -> None:
        self.m, self.demand, self.strict, self.convert = mgr, demand, strict, convert
        self.rng = random.Random(seed)
        self.bs = mgr.block_size
        self.pid = os.getpid()
        pr = random.Random(prompt_seed)
        roots = [[pr.randrange(VOCAB) for _ in range(2 * self.bs)] for _ in range(4)]
        self.prompts = [pr.choice(roots) + [pr.randrange(VOCAB) for _ in range(
            pr.randrange(0, 3 * self.bs + 1))] for _ in range(12)]
        self.tables = {}       # rid -> [tokens, extra, blocks published]
        self.foreign = {}      # rid -> blocks: forks of others' tables (content not ours)
        self.private = {}      # block id -> [key (None: content unknown), references held]
        self.counter = 0
        self.r = dict(ops=0, out_of_blocks=0, capacity_errors=0, payload_mismatches=0,
                      mismatch_details=[], violations=0, violation_details=[],
                      verified_blocks=0, acquired_hits=0, self_leaks=0, max_latency=0.0,
                      counts={})

    # ---------------------------------------------------------- reporting
    def on_problem(self) -> None:
        """Called after each mismatch or violation is recorded (a hook)."""

    def problem(self, kind: str, what) -> None:
        """Record a payload mismatch (``kind`` "mismatch") or violations."""
        if kind == "mismatch":
            self.r["payload_mismatches"] += 1
            if len(self.r["mismatch_details"]) < 5:
                self.r["mismatch_details"].append(what)
        else:
            self.r["violations"] += len(what)
            self.r["violation_details"] = (self.r["violation_details"] + list(what))[:10]
        self.on_problem()
        if self.strict:
            raise AssertionError(f"{kind}: {what}")

    def call(self, fn, *a, **kw):
        """Run one API call, counted, its latency kept if the longest yet."""
        self.r["ops"] += 1
        t0 = time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            self.r["max_latency"] = max(self.r["max_latency"], time.monotonic() - t0)

    def failed(self, e: Exception, free=()) -> None:
        """Count a refusal for lack of room (a CapacityError is an
        OutOfBlocksError too), and free the loose blocks ``free``."""
        self.r["capacity_errors" if isinstance(e, CapacityError) else "out_of_blocks"] += 1
        if free:
            self.call(self.m.free_block_batch, list(free))

    def attempt(self, errors, fn, *a, free=()):
        """``call(fn, *a)``, or REFUSED after ``failed`` for one of ``errors``."""
        try:
            return self.call(fn, *a)
        except errors as e:
            self.failed(e, free)
            return REFUSED

    # ------------------------------------------------------------ payload
    def held(self) -> int:
        return (sum(-(-len(t[0]) // self.bs) for t in self.tables.values())
                + sum(self.foreign.values()) + sum(v[1] for v in self.private.values()))

    def write_chain(self, ids, tokens, extra, a: int, b: int, first_block: int = 0) -> None:
        self.r["ops"] += P.write_chain(self.m, ids, tokens, extra, a, b, first_block, self.convert)

    def verify_chain(self, what: str, ids, tokens, extra, n: int) -> None:
        if n <= 0:
            return
        self.r["ops"] += self.m.layout.num_layers
        self.r["verified_blocks"] += -(-n // self.bs)
        bad = P.chain_mismatch(self.m, ids, tokens, extra, n)
        if bad:
            self.problem("mismatch", f"{what}: {bad}")

    def verify_table(self, rid: str) -> None:
        tokens, extra, _ = self.tables[rid]
        t = self.call(self.m.get_block_table, rid)
        if t is None:
            return self.problem("violation", [f"my table {rid} vanished"])
        ids, n = t.block_ids, t.num_tokens
        if n != len(tokens) or len(ids) != -(-len(tokens) // self.bs):
            self.problem("violation", [f"table {rid}: {n} tokens in {len(ids)} blocks, "
                                       f"expected {len(tokens)}"])
        self.verify_chain(f"table {rid}", ids, tokens, extra, len(tokens))

    def write_private(self, b: int) -> None:
        self.counter += 1
        key = P.private_key(self.pid, b, self.counter)
        self.private[b] = [key, 1]
        self.r["ops"] += self.m.layout.num_layers
        P.write_private(self.m, b, key, self.convert)

    def verify_private(self, b: int) -> None:
        key = self.private[b][0]
        if key is None:
            return
        self.r["ops"] += self.m.layout.num_layers
        self.r["verified_blocks"] += 1
        bad = P.private_mismatch(self.m, b, key)
        if bad:
            self.problem("mismatch", bad)

    # ----------------------------------------------------------- requests
    def new_rid(self) -> str:
        self.counter += 1
        return f"w{self.pid}-{self.counter}"

    def op_request(self) -> None:
        """A new request: acquire its cached prefix, fill the rest, publish."""
        tokens = self.rng.choice(self.prompts) + [self.rng.randrange(VOCAB)
                                                  for _ in range(self.rng.randrange(2 * self.bs))]
        extra = P.extra_for(self.rng.choice(SALTS))
        need = -(-len(tokens) // self.bs)
        self.make_room(need)
        if self.held() + need > self.demand:
            return
        rid = self.new_rid()
        if self.rng.random() < 0.5:
            # the table first, the prefix acquired straight into it (one step)
            t = self.attempt(CapacityError, self.m.create_block_table, rid)
            if t is REFUSED:
                return
            got = self.attempt(CapacityError, self.m.acquire_computed_blocks, tokens, extra, t)
            if got is REFUSED:
                self.call(self.m.delete_block_table, rid)
                return
            blocks = None
        else:
            got = self.attempt(CapacityError, self.m.acquire_computed_blocks, tokens, extra)
            if got is REFUSED:
                return
            blocks = got[0]
        ids, ncached = [b.block_id for b in got[0]], got[1]
        if ncached != len(ids) * self.bs:
            self.problem("violation", [f"acquired {len(ids)} blocks for {ncached} tokens"])
        self.r["acquired_hits"] += len(ids)
        self.verify_chain("acquired prefix", ids, tokens, extra, ncached)
        if blocks is not None:
            t = self.attempt(CapacityError, self.m.create_block_table, rid, free=ids)
            if t is REFUSED:
                return
            for b in blocks:
                self.call(self.m.add_block_to_table, t, b, self.bs)
        self.tables[rid] = [tokens[:ncached], extra, len(ids)]
        if ncached < len(tokens) and self.rng.random() < 0.3:
            self.fill(rid, tokens[ncached:])
        else:
            self.append(rid, tokens[ncached:])

    def fill(self, rid: str, rest) -> None:
        """Extend a table whose tokens fill whole blocks with new blocks,
        each written before it is added (the other way to grow a table)."""
        rec = self.tables[rid]
        n0 = len(rec[0])
        new = self.attempt(OutOfBlocksError, self.m.get_new_blocks, -(-len(rest) // self.bs))
        if new is REFUSED:
            return
        tokens = rec[0] + list(rest)
        for i, b in enumerate(new):
            lo = n0 + i * self.bs
            hi = min(len(tokens), lo + self.bs)
            self.write_chain([b.block_id], tokens, rec[1], lo, hi, lo // self.bs)
            if self.attempt(CapacityError, self.m.add_block_to_table, rid, b, hi - lo,
                            free=new[i:]) is REFUSED:
                break
            rec[0] = tokens[:hi]
        self.publish(rid)

    def append(self, rid: str, new_tokens) -> None:
        rec = self.tables[rid]
        n0 = len(rec[0])
        try:
            if self.rng.random() < 0.2:
                self.call(self.m.can_append, rid, len(new_tokens))
            # by id or by table object: the table object takes the fused C
            # path, which holds the lock only for its own C op
            which = self.call(self.m.get_block_table, rid) if self.rng.random() < 0.5 else None
            out = self.call(self.m.prepare_append, which or rid, len(new_tokens))
        except OutOfBlocksError as e:
            self.failed(e)
            if not isinstance(e, CapacityError) and self.rng.random() < 0.5:
                self.op_delete()
            return
        rec[0] = rec[0] + list(new_tokens)
        self.write_chain([b.block_id for b in out], rec[0], rec[1], n0, len(rec[0]),
                         n0 // self.bs)
        self.publish(rid)

    def publish(self, rid: str) -> None:
        """Publish a table's full blocks, now and then from block 0 again."""
        rec = self.tables[rid]
        full = len(rec[0]) // self.bs
        if full > rec[2] and self.rng.random() < 0.7:
            ids = self.call(self.m.get_block_table, rid).block_ids
            start = self.rng.choice([0, rec[2]])
            self.call(self.m.cache_full_blocks, ids, rec[0], start, full, rec[1])
            rec[2] = full

    def own_table(self):
        return self.rng.choice(sorted(self.tables)) if self.tables else None

    def op_append(self) -> None:
        """A decode step: append tokens to one of our tables (COW after a fork)."""
        rid = self.own_table()
        if rid is None or len(self.tables[rid][0]) >= MAX_TABLE_BLOCKS * self.bs:
            return self.op_request()
        if self.held() + 2 > self.demand:
            self.make_room(2)
            if rid not in self.tables:
                return
        self.append(rid, [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, self.bs + 2))])

    def op_fork(self) -> None:
        rid = self.own_table()
        if rid is None:
            return
        tokens, extra, pub = self.tables[rid]
        if self.held() + -(-len(tokens) // self.bs) > self.demand:
            return self.make_room(1)
        new = self.new_rid()
        if self.attempt(CapacityError, self.m.fork_block_table, rid, new) is REFUSED:
            return
        self.tables[new] = [list(tokens), extra, pub]

    def op_foreign_fork(self) -> None:
        """Fork another process's table, append to it (COW) and write junk
        into what it appended: the owner's own verification catches a
        block that should have been copied and was not."""
        if len(self.foreign) >= MAX_FOREIGN or self.held() + MAX_TABLE_BLOCKS > self.demand:
            return
        others = sorted(r for r in self.m.request_tables
                        if r not in self.tables and r not in self.foreign)
        if not others:
            return
        dst = self.new_rid()
        try:
            t = self.call(self.m.fork_block_table, self.rng.choice(others), dst)
        except KeyError:
            return          # its owner deleted it meanwhile
        except CapacityError as e:
            return self.failed(e)
        self.foreign[dst] = len(t)
        before, n = t.num_tokens, self.rng.randint(1, self.bs)
        out = self.attempt(OutOfBlocksError, self.m.prepare_append,
                           t if self.rng.random() < 0.5 else dst, n)
        if out is REFUSED:
            return
        self.foreign[dst] = len(t)
        self.write_chain([b.block_id for b in out], [7777] * (before + n), ("junk",),
                         before, before + n, before // self.bs)

    def op_verify(self) -> None:
        rid = self.own_table()
        if rid is not None:
            self.verify_table(rid)

    def op_delete(self) -> None:
        rids = sorted(self.tables) + sorted(self.foreign)
        if not rids:
            return
        rid = self.rng.choice(rids)
        if rid in self.tables and self.rng.random() < 0.3:
            self.verify_table(rid)
        self.call(self.m.delete_block_table, rid)
        self.tables.pop(rid, None)
        self.foreign.pop(rid, None)

    def make_room(self, need: int) -> None:
        while self.held() + need > self.demand and (self.tables or self.foreign or self.private):
            if self.private and (not (self.tables or self.foreign) or self.rng.random() < 0.5):
                self.op_free()
            else:
                self.op_delete()

    # ------------------------------------------------------ private blocks
    def op_alloc(self) -> None:
        if self.held() + 1 > self.demand:
            return self.make_room(1)
        try:
            b = self.call(self.m.allocate_block)
        except CapacityError as e:
            return self.failed(e)
        if b is None:
            self.r["out_of_blocks"] += 1
        elif b.ref_count < 1:
            self.problem("violation", [f"allocated block {b.block_id} has ref_count {b.ref_count}"])
        else:
            self.write_private(b.block_id)

    def op_get_new(self) -> None:
        k = self.rng.randint(1, 3)
        if self.held() + k > self.demand:
            return self.make_room(k)
        blocks = self.attempt(OutOfBlocksError, self.m.get_new_blocks, k)
        for b in (() if blocks is REFUSED else blocks):
            self.write_private(b.block_id)

    def release_private(self, ids, batch: bool) -> None:
        for b in ids:
            self.verify_private(b)
        if not batch and len(ids) == 1 and self.private[ids[0]][1] == 1:
            self.call(self.m.free_block, ids[0])
        else:
            self.call(self.m.free_block_batch, [b for b in ids for _ in range(self.private[b][1])])
        for b in ids:
            del self.private[b]

    def op_free(self, batch: bool = False) -> None:
        if self.private:
            k = min(len(self.private), self.rng.randint(1, 3)) if batch else 1
            self.release_private(self.rng.sample(sorted(self.private), k), batch)

    def op_free_batch(self) -> None:
        self.op_free(batch=True)

    def op_touch(self) -> None:
        if self.private and self.held() < self.demand:
            b = self.rng.choice(sorted(self.private))
            if self.attempt(CapacityError, self.m.touch, [b]) is not REFUSED:
                self.private[b][1] += 1

    # ------------------------------------------------------------- others
    def op_acquire(self) -> None:
        tokens = self.rng.choice(self.prompts)
        extra = P.extra_for(self.rng.choice(SALTS))
        got = self.attempt(CapacityError, self.m.acquire_computed_blocks, tokens, extra)
        if got is REFUSED:
            return
        n, ids = got[1], [b.block_id for b in got[0]]
        self.r["acquired_hits"] += len(ids)
        self.verify_chain("acquired prompt", ids, tokens, extra, n)
        if ids:
            self.call(self.m.free_block_batch, ids)

    def op_lookup(self) -> None:
        """get_computed_blocks, then now and then touch what it found: racy by
        design (it may be evicted and reused meanwhile), but safe."""
        blocks, _ = self.call(self.m.get_computed_blocks, self.rng.choice(self.prompts),
                              P.extra_for(self.rng.choice(SALTS)))
        if blocks and self.held() < self.demand and self.rng.random() < 0.5:
            b = blocks[0].block_id
            if self.attempt(CapacityError, self.m.touch, [b]) is not REFUSED:
                self.private.setdefault(b, [None, 0])[1] += 1
        self.call(self.m.get_memory_usage)

    def op_stats(self) -> None:
        s = self.call(self.m.get_stats)
        if not s.allocated_blocks + s.free_blocks == s.total_blocks > s.free_blocks >= 0:
            self.problem("violation", [f"inconsistent stats {s}"])

    def op_evict(self) -> None:
        self.call(self.m.evict_lru_blocks, self.rng.randint(1, 4))

    def op_check(self) -> None:
        problems = self.call(self.m.check)
        if problems:
            self.problem("violation", problems)

    # -------------------------------------------------------------- driving
    def step(self) -> str:
        """Run one random operation; returns its name."""
        name = self.rng.choices([n for n, _ in OPS], [w for _, w in OPS])[0]
        if name in ("delete", "free", "free_batch") and self.rng.random() * self.demand > self.held():
            name = "append"      # grow towards the demand; release mostly under pressure
        getattr(self, "op_" + name)()
        self.r["counts"][name] = self.r["counts"].get(name, 0) + 1
        return name

    def release(self) -> None:
        """Verify and release everything held; a leak of this manager is a problem."""
        for rid in sorted(self.tables) + sorted(self.foreign):
            if rid in self.tables:
                self.verify_table(rid)
            self.call(self.m.delete_block_table, rid)
        self.tables.clear()
        self.foreign.clear()
        if self.private:
            self.release_private(sorted(self.private), batch=True)
        mine = [h for h in self.m.holdings() if h["slot"] == self.m.pool.slot]
        if mine and (mine[0]["tables"] or mine[0]["table_blocks"] or mine[0]["loose_blocks"]):
            self.r["self_leaks"] += 1
            self.on_problem()
            if self.strict:
                raise AssertionError(f"left behind after release: {mine[0]}")

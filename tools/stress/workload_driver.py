"""One random workload over a shared pool, checking every payload it reads.

The driver of the stress tool's workers (:mod:`tools.stress.worker`) and of
the tests' random workers (``tests/_proc_server.py random``): a weighted
random mix of the whole API (``OPS`` and its operations, in
:mod:`tools.stress.workload_ops`) holding at most ``demand`` blocks. Every block
read back is compared with what its writer wrote (see
:mod:`tools.stress.workload_payload`); a wrong byte, a violated invariant or a leak
is recorded in ``r``, and with ``strict`` also raised as an AssertionError.
This module holds that bookkeeping, the payload checks and the driving
(``step``, ``release``).
"""

from __future__ import annotations

import os
import random
import time

from shmcache.errors import CapacityError
from tools.stress import workload_payload as P
from tools.stress.workload_ops import OPS, REFUSED, VOCAB, WorkloadOps


class Workload(WorkloadOps):
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

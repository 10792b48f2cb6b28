"""How the pool scales with processes: ``python -m tools.bench.scale``.

N independent processes attach to one pool by name and run one mix for a
fixed time, all starting together; the table gives ops/s summed over the
processes, the ratio to N=1, and the p50/p99 of the waits for the pool lock
(a wait: the time one lock acquisition waited for the lock: a fused C
operation's wait for its turn (hot_enter.h's take_turn), and any wait asleep
in the kernel after a spin failed, in the lock's slow path or in a fused
operation; ``waits/op`` is how many such waits one operation had on average:
a serving op takes the lock 13 times, a batched op twice).

Mixes (block size 16):

* ``batched``: ``get_new_blocks(16)`` + ``free_block_batch`` of them.
* ``reserved``: the same, each process with a reserve of 64 blocks
  (``set_reserve(64)``: its frees and allocations skip the pool lock).
* ``serving``: one request's life: create a table; ``acquire_computed_blocks``
  on a shared 32-block system prompt plus about 4 blocks of its own (added to
  the table); ``prepare_append`` for the rest, then ``cache_full_blocks``;
  8 x ``prepare_append(t, 1)``; delete the table.
* ``perblock``: the same request through the seed's per-block calls, as a
  consumer written against vllm-mlx's ``paged_cache`` makes them: create a
  table; ``get_computed_blocks`` on the 32-block system prompt plus about 4
  blocks of its own; ``add_block_to_table`` for each block found;
  ``prepare_append`` for the rest, then ``cache_full_blocks``;
  8 x ``prepare_append(t, 1)``; delete the table.
* ``control``: the serving op's own Python work with no pool at all (the
  request's tokens, and the chain hashes its lookup and its publication
  compute): how far the machine itself lets N processes scale. Not in the
  default ``--mix``.

    python -m tools.bench.scale --processes 1,2,4,8,16 --seconds 4

``--repeat K`` runs every point K times, in interleaved rounds, and prints
medians with their ranges; ``--steps`` also times each step of a serving op
and the lock holds of its fused C calls (the table's second part: where the
time goes as N grows).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from tools.bench import lock_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BS = 16
SYSTEM_BLOCKS = 32
RESERVE = 64            # the reserved mix's reserve per process
MIXES = ("batched", "reserved", "serving", "perblock", "control")
# the serving mix's steps, as --steps times them
STEPS = ("tokens", "create", "acquire", "prepare", "publish", "append x8", "delete")


def _pct(xs, q) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------ worker
def _serving_steps(mgr, rng, system, pid, end) -> tuple:
    """The serving mix, each step timed (``--steps`` reports it; the timing
    costs about 0.5 µs of a 100-200 µs op): (ops, seconds spent in each
    step, summed over the ops, in STEPS order)."""
    pc = time.perf_counter
    took = [0.0] * len(STEPS)
    ops = 0
    while time.time() < end:
        rid = f"p{pid}.{ops}"
        t0 = pc()
        tokens = system + [rng.randrange(1 << 20, 1 << 30) for _ in range(4 * BS + rng.randrange(BS))]
        t1 = pc()
        t = mgr.create_block_table(rid)
        t2 = pc()
        _, cached = mgr.acquire_computed_blocks(tokens, table=t)
        t3 = pc()
        mgr.prepare_append(t, len(tokens) - cached)
        t4 = pc()
        mgr.cache_full_blocks(t.block_ids, tokens, cached // BS, len(tokens) // BS)
        t5 = pc()
        for _ in range(8):
            mgr.prepare_append(t, 1)
        t6 = pc()
        mgr.delete_block_table(rid)
        t7 = pc()
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6),
                                    (t6, t7))):
            took[i] += b - a
        ops += 1
    return ops, took


def worker(name: str, mix: str, start_at: float, seconds: float, seed: int, out: str,
           steps: bool = False, trace: bool = False) -> int:
    import shmcache
    mgr = shmcache.attach(name)
    waits = mgr.pool.lock.wait_log = []
    native = mgr.pool.native
    log_c = hasattr(native, "log_waits")        # (the C accelerator: its own waits)
    if log_c:
        native.log_waits(True)
        native.log_holds(2 if trace else int(steps))
        mgr.pool.lock.trace = trace
    rng = random.Random(seed)
    system = list(range(SYSTEM_BLOCKS * BS))
    ops = 0
    pid = os.getpid()
    while time.time() < start_at:
        time.sleep(0.0005)
    end = start_at + seconds
    took = None                                 # (the serving mix's steps, --steps)
    if mix in ("batched", "reserved"):
        if mix == "reserved":
            mgr.set_reserve(RESERVE)
        while time.time() < end:
            for _ in range(64):
                mgr.free_block_batch(mgr.get_new_blocks(16))
            ops += 64
    elif mix == "control":
        from shmcache.shm.blocks import chain_hashes
        root = os.urandom(16)
        while time.time() < end:
            for _ in range(4):
                tokens = system + [rng.randrange(1 << 20, 1 << 30) for _ in range(4 * BS + rng.randrange(BS))]
                chain_hashes(root, BS, tokens, len(tokens) // BS)
                chain_hashes(root, BS, tokens, len(tokens) // BS, None, None, SYSTEM_BLOCKS)
                ops += 1
    elif mix == "perblock":
        while time.time() < end:
            rid = f"p{pid}.{ops}"
            tokens = system + [rng.randrange(1 << 20, 1 << 30) for _ in range(4 * BS + rng.randrange(BS))]
            t = mgr.create_block_table(rid)
            found, cached = mgr.get_computed_blocks(tokens)
            for b in found:
                mgr.add_block_to_table(t, b, BS)
            mgr.prepare_append(t, len(tokens) - cached)
            mgr.cache_full_blocks(t.block_ids, tokens, cached // BS, len(tokens) // BS)
            for _ in range(8):
                mgr.prepare_append(t, 1)
            mgr.delete_block_table(rid)
            ops += 1
    else:
        ops, took = _serving_steps(mgr, rng, system, pid, end)
    holds = held = 0
    if log_c:
        waits.extend(native.take_waits())
        holds, held = native.take_holds()
        if trace:
            np.save(out + ".trace.npy", np.asarray(native.take_trace(), dtype=np.int64))
    with open(out, "w") as f:
        json.dump({"ops": ops, "waits_ns": waits, "steps_s": took if steps else None,
                   "holds": holds, "held_ns": held}, f)
    mgr.close()
    return 0


# ------------------------------------------------------------------ parent
def run_point(mix: str, n: int, seconds: float, max_blocks: int, steps: bool = False,
              trace: bool = False) -> dict:
    import shmcache
    name = f"bscale-{os.getpid()}-{mix}-{n}"
    mgr = shmcache.create_pool(name, block_size=BS, max_blocks=max_blocks,
                               max_slots=max(64, 2 * n + 8), max_tables=max(1024, 64 * n),
                               max_refs=8 * max_blocks)
    tmp = tempfile.mkdtemp(prefix="bscale-")
    procs = []
    try:
        # the shared system prompt, published once
        sysp = list(range(SYSTEM_BLOCKS * BS))
        t = mgr.create_block_table("system")
        mgr.prepare_append(t, len(sysp))
        mgr.cache_full_blocks(t.block_ids, sysp, 0, SYSTEM_BLOCKS)
        mgr.delete_block_table("system")
        start_at = time.time() + 1.0 + 0.15 * n       # after every process has attached
        for i in range(n):
            out = os.path.join(tmp, f"{i}.json")
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "tools.bench.scale", "--worker", name, "--mix", mix,
                 "--start-at", repr(start_at), "--seconds", str(seconds), "--seed", str(i),
                 "--out", out] + (["--steps"] if steps else []) + (["--trace"] if trace else []),
                cwd=ROOT), out))
        results = []
        for p, out in procs:
            if p.wait(timeout=seconds + 120) != 0:
                raise RuntimeError(f"a {mix} worker exited with {p.returncode}")
            with open(out) as f:
                results.append(json.load(f))
        ops = sum(r["ops"] for r in results)
        waits = [w for r in results for w in r["waits_ns"]]
        problems = mgr.check()
        step_us = None
        if steps and mix == "serving":
            step_us = [sum(r["steps_s"][i] for r in results) / max(1, ops) * 1e6
                       for i in range(len(STEPS))]
            holds = sum(r["holds"] for r in results)
            held = sum(r["held_ns"] for r in results) / 1e3
            # the fused ops' own holds of the lock (the C ones: all of this mix's)
            step_us += [held / max(1, ops), held / max(1, holds)]
        traced = None
        if trace:
            traced = lock_trace.analyse([np.load(out + ".trace.npy") for _, out in procs
                                         if os.path.exists(out + ".trace.npy")])
        return {"mix": mix, "processes": n, "ops_per_s": ops / seconds, "step_us": step_us,
                "trace": traced,
                "waits_per_op": len(waits) / max(1, ops),
                "wait_p50_us": _pct(waits, 0.50) / 1e3, "wait_p99_us": _pct(waits, 0.99) / 1e3,
                "violations": len(problems)}
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        mgr.destroy()
        shutil.rmtree(tmp, ignore_errors=True)


def table(rows) -> str:
    """One line per (mix, N). With several rounds (--repeat) each figure is
    the median over the rounds, with the range beside it; a ratio is taken
    within each round (that round's N=1), and the wait p99 is the worst
    round's."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["mix"], r["processes"]), []).append(r)
    base = {}
    for (mix, n), rs in groups.items():
        if mix not in base:
            base[mix] = [r["ops_per_s"] for r in rs]
    lines = ["| mix | N | ops/s | x N=1 | waits/op | wait p50 | wait p99 |",
             "|---|---|---|---|---|---|---|"]

    def fig(xs, fmt):
        med = statistics.median(xs)
        if len(xs) == 1:
            return fmt.format(med)
        return f"{fmt.format(med)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"

    for (mix, n), rs in groups.items():
        ops = [r["ops_per_s"] for r in rs]
        ratios = [o / b for o, b in zip(ops, base[mix])]
        lines.append(f"| {mix} | {n} | {fig(ops, '{:,.0f}')} | {fig(ratios, '{:.2f}')} | "
                     f"{statistics.median(r['waits_per_op'] for r in rs):.3f} | "
                     f"{statistics.median(r['wait_p50_us'] for r in rs):.0f} µs | "
                     f"{max(r['wait_p99_us'] for r in rs):.0f} µs |")
    return "\n".join(lines)


def steps_table(rows) -> str:
    """Mean microseconds one serving op spent in each step, per N (--steps),
    then the microseconds it held the lock (in the fused C ops), and the mean
    length of one hold."""
    rows = [r for r in rows if r.get("step_us")]
    if not rows:
        return ""
    heads = STEPS + ("lock held / op", "µs / hold")
    lines = ["| N | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for r in rows:
        lines.append(f"| {r['processes']} | " + " | ".join(f"{u:.1f}" for u in r["step_us"]) + " |")
    return "mean µs per serving op in each step:\n" + "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", default=f"1,2,{os.cpu_count() or 2}",
                    help="comma-separated process counts (default 1,2,<CPUs>)")
    ap.add_argument("--seconds", type=float, default=4.0, help="run time per point (default 4)")
    ap.add_argument("--mix", default="batched,reserved,serving",
                    help="comma-separated mixes: batched, reserved, serving, perblock, control (default "
                         "batched,reserved,serving)")
    ap.add_argument("--max-blocks", type=int, default=65536)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over every point, interleaved; figures are medians with ranges "
                         "(default 1)")
    ap.add_argument("--steps", action="store_true",
                    help="serving mix: also time each step of a request (mean µs per op, per N)")
    ap.add_argument("--trace", action="store_true",
                    help="trace every hold of the pool lock and report how its time splits into "
                         "held, handed over and idle (tools/bench/lock_trace.py)")
    for a in ("--worker", "--start-at", "--seed", "--out"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.mix, float(args.start_at), args.seconds, int(args.seed),
                      args.out, args.steps, args.trace)
    try:
        counts = sorted({int(x) for x in args.processes.split(",")})
    except ValueError:
        ap.error(f"--processes: not a list of integers: {args.processes!r}")
    if not counts or counts[0] < 1:
        ap.error("--processes: counts must be at least 1")
    mixes = args.mix.split(",")
    for mix in mixes:
        if mix not in MIXES:
            ap.error(f"--mix: unknown mix {mix!r}")
    if args.repeat < 1:
        ap.error("--repeat: must be at least 1")
    rows = []
    # rounds interleaved: every (mix, N) once per round, so that the
    # machine's drift lands on every point alike
    for k in range(args.repeat):
        for mix in mixes:
            for n in counts:
                print(f"[bench_scale] round {k + 1}/{args.repeat}: {mix} N={n} ...",
                      file=sys.stderr, flush=True)
                rows.append(run_point(mix, n, args.seconds, args.max_blocks, args.steps,
                                     args.trace))
    rows.sort(key=lambda r: mixes.index(r["mix"]))      # (stable: rounds stay in order)
    print(f"python -m tools.bench.scale --processes {args.processes} --seconds {args.seconds:g} "
          f"--repeat {args.repeat} --mix {args.mix} (CPUs: {os.cpu_count()})")
    print(table(rows))
    if args.steps:
        print(steps_table(rows))
    if args.trace:
        print(lock_trace.report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["violations"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

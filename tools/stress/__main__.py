"""Memory-pressure stress of a shared pool: ``python -m tools.stress``.

The parent creates a pool and spawns ``--processes`` workers (``python -m
tools.stress --worker ...``) that attach by name and run the random workload
of :mod:`tools.stress.workload_driver` (requests that acquire a cached prefix and
publish their full blocks, decode appends with copy-on-write after forks,
forks of each other's tables, verification reads, private allocations,
touch, free, batch free, eviction, lookups, stats, checks), each bounded by
a demand so that together they ask for ``--overcommit`` times the pool's
blocks. Every block read back is compared with the bytes its writer (or
publisher) wrote (see :mod:`tools.stress.workload_payload`):

* a block of a request's table holds, at each token position, a pattern
  derived from the chain of token ids up to its block (and the request's
  extra keys), so every publisher of the same chain writes the same bytes;
* a private block (allocated, not in a table, held only by its allocator)
  holds a pattern derived from (pid, block id, a counter).

``--kill-every`` SIGKILLs a random worker at that interval and starts a new
one; with ``--kill-waiters`` it prefers one asleep on the pool lock (the
kernel's view, from /proc), so waiters die as well as holders. The report
has the slowest wait for the lock (``max_lock_wait_s``) and the p99 of
every wait (``lock_wait_p99_s``). Workers report progress and peak RSS/PSS through a result file each
(rewritten atomically a few times a second, so a killed worker's figures
up to its death are kept). At the end the parent stops every worker (they
release everything and detach), runs ``reclaim_dead`` and the full check,
measures what is still referenced, destroys the pool (also on failure or
Ctrl-C) and reports; exit status 1 on any violation, payload mismatch, leak,
worker error or leftover segment, 130 when interrupted, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from tools.stress.lockwatch import lock_waiters
from tools.stress.worker import (EXIT_ATTACH_FULL, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS,
                                 worker_main)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ================================================================== parent
class Child:
    def __init__(self, proc, path) -> None:
        self.proc, self.path, self.killed, self.exit = proc, path, False, None
        self.waiting = 0

    def result(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}


def spawn(args, name, demand, rng, tmp, children) -> None:
    path = os.path.join(tmp, f"w{len(children)}.json")
    cmd = [sys.executable, "-m", "tools.stress", "--worker", name, "--result", path,
           "--demand", str(demand), "--seed", str(rng.randrange(2**31)),
           "--prompt-seed", str(args.seed), "--parent", str(os.getpid()),
           "--reserve", str(args.reserve)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    children.append(Child(subprocess.Popen(cmd, cwd=ROOT, env=env), path))


def totals(children) -> dict:
    t = dict(ops=0, out_of_blocks=0, capacity_errors=0, payload_mismatches=0,
             violations=0, verified_blocks=0, self_leaks=0)
    for c in children:
        r = c.result()
        for k in t:
            t[k] += int(r.get(k, 0))
    return t


def parent_main(args) -> int:
    import shmcache
    from shmcache.shm import segment
    # Ctrl-C stops the run even when started with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    rng = random.Random(args.seed)
    name = args.name or f"stress-{os.getpid()}"
    total = args.max_blocks - 1
    demand = max(2, math.ceil(args.overcommit * total / args.processes))
    m = shmcache.create_pool(
        name, block_size=args.block_size, max_blocks=args.max_blocks, num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype="float32",
        max_slots=max(64, 4 * args.processes), max_tables=max(256, 8 * args.processes),
        max_refs=8 * args.max_blocks + 64 * args.processes)
    tmp = tempfile.mkdtemp(prefix="shmcache-stress-")
    children, errors, interrupted, kills, waiter_kills = [], [], False, 0, 0
    tty = sys.stderr.isatty()
    t0 = time.monotonic()
    try:
        try:
            for _ in range(args.processes):
                spawn(args, name, demand, rng, tmp, children)
            next_kill = t0 + (args.kill_every or math.inf)
            next_progress = t0
            while (now := time.monotonic()) < t0 + args.seconds:
                for c in children:
                    if c.exit is None and (rc := c.proc.poll()) is not None:
                        c.exit = rc
                        if rc == EXIT_ATTACH_FULL:
                            m.reclaim_dead()
                        else:
                            errors.append(f"worker {c.proc.pid} exited with {rc}: "
                                          f"{(c.result().get('error') or '')[-300:]}")
                        spawn(args, name, demand, rng, tmp, children)
                if now >= next_kill:
                    live = [c for c in children if c.exit is None]
                    if live:
                        c = pick_victim(args, live, rng, segment.path_for(name))
                        waiter_kills += c.waiting
                        c.proc.send_signal(signal.SIGKILL)
                        c.exit, c.killed = c.proc.wait(), True
                        kills += 1
                        if (m.pool.slots["state"] == 0).sum() < args.processes + 2:
                            m.reclaim_dead()
                        spawn(args, name, demand, rng, tmp, children)
                    next_kill = now + args.kill_every
                if now >= next_progress:
                    t, el = totals(children), max(now - t0, 1e-9)
                    line = (f"[stress] {el:5.1f}/{args.seconds:g}s procs "
                            f"{sum(c.exit is None for c in children)} ops {t['ops']} "
                            f"({t['ops'] / el:.0f}/s) kills {kills} ({waiter_kills} waiting) out_of_blocks "
                            f"{t['out_of_blocks']} mismatches {t['payload_mismatches']} "
                            f"free {m.free_blocks}/{total}")
                    sys.stderr.write(("\r\x1b[K" + line) if tty else line + "\n")
                    sys.stderr.flush()
                    next_progress = now + (0.5 if tty else 1.0)
                time.sleep(0.05)
        except KeyboardInterrupt:
            interrupted = True
        elapsed = time.monotonic() - t0
        if tty:
            sys.stderr.write("\n")
        stuck = stop_children(children)
        for c in children:
            r = c.result()
            if r.get("error"):
                errors.append(f"worker {c.proc.pid}: {r['error'][-300:]}")
        errors += [f"worker {pid} did not stop in time (SIGKILLed)" for pid in stuck]
        report = final_report(args, m, children, elapsed, kills, demand, errors)
        report["waiter_kills"] = waiter_kills
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        m.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
    report["segments_left"] = sum(1 for n in segment.list_names() if n == name)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    failed = (report["violations"] or report["payload_mismatches"] or report["leaked_blocks"]
              or report["tables_left"] or report["worker_errors"] or report["segments_left"])
    return 1 if failed else (130 if interrupted else 0)


def pick_victim(args, live, rng, path):
    """A random live worker; with ``--kill-waiters``, preferably one that is
    asleep on the pool lock right now (watched for up to 200 ms), so that
    waiters die as well as holders. Sets ``waiting`` on the one picked."""
    if args.kill_waiters:
        by_pid = {c.proc.pid: c for c in live}
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            waiting = lock_waiters(path, [str(p) for p in by_pid])
            if waiting:
                c = by_pid[rng.choice(sorted(waiting))]
                c.waiting = 1
                return c
            time.sleep(0.0005)
    c = rng.choice(live)
    c.waiting = 0
    return c


def lock_wait_p99(children) -> float:
    """p99 of every wait for the pool lock in every worker, seconds (each
    worker reports its count of waits and its slowest 1,024)."""
    n, top = 0, []
    for c in children:
        r = c.result()
        n += int(r.get("lock_waits", 0))
        top += r.get("lock_waits_top_ns", [])
    if not n:
        return 0.0
    top.sort(reverse=True)
    k = max(1, math.ceil(0.01 * n))      # the p99 is the k-th slowest wait
    return top[min(k, len(top)) - 1] / 1e9


def stop_children(children) -> list:
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        c.proc.send_signal(signal.SIGTERM)
    deadline, stuck = time.monotonic() + 30, []
    for c in live:
        try:
            c.exit = c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.exit = c.proc.wait()
            stuck.append(c.proc.pid)
    return stuck


def final_report(args, m, children, elapsed, kills, demand, errors) -> dict:
    from shmcache.pool import recovery
    reclaimed = m.reclaim_dead()
    problems = m.check()
    stats = m.get_stats()
    scan = recovery.scan_stats(m.pool)
    others = [h for h in m.holdings() if h["slot"] != m.pool.slot]
    t = totals(children)
    procs = []
    for c in children:
        r = c.result()
        procs.append({"pid": c.proc.pid, "ops": r.get("ops", 0), "killed": c.killed,
                      "exit": c.exit, "peak_rss_bytes": r.get("peak_rss_bytes", 0),
                      "peak_pss_bytes": r.get("peak_pss_bytes", 0)})
    details = [d for c in children for d in c.result().get("violation_details", [])]
    mism = [d for c in children for d in c.result().get("mismatch_details", [])]
    me = psutil.Process().memory_full_info()
    return {
        "ops": t["ops"], "ops_per_s": round(t["ops"] / max(elapsed, 1e-9), 1),
        "kills": kills, "out_of_blocks": t["out_of_blocks"],
        "violations": len(problems) + t["violations"],
        "payload_mismatches": t["payload_mismatches"],
        "leaked_blocks": scan["allocated_blocks"] - 1,
        "max_lock_wait_s": int(m.pool.counters.lock_wait_ns) / 1e9,
        "lock_wait_p99_s": lock_wait_p99(children),
        "lock_waits": sum(int(c.result().get("lock_waits", 0)) for c in children),
        "peak_rss_bytes": max((p["peak_rss_bytes"] for p in procs), default=0),
        "peak_pss_bytes": max((p["peak_pss_bytes"] for p in procs), default=0),
        "per_process": procs,
        "parent_rss_bytes": me.rss, "parent_pss_bytes": getattr(me, "pss", 0),
        "segments_left": None,
        "violation_details": (problems + details)[:20], "mismatch_details": mism[:20],
        "tables_left": int(m.pool.counters.num_tables), "holders_left": len(others),
        "worker_errors": len(errors) + t["self_leaks"], "error_details": errors[:10],
        "capacity_errors": t["capacity_errors"], "verified_blocks": t["verified_blocks"],
        "reclaimed_at_end": reclaimed, "recoveries": int(m.pool.counters.recoveries),
        "reclaimed_refs_total": int(m.pool.counters.reclaimed),
        "cache_hits": stats.cache_hits, "cache_misses": stats.cache_misses,
        "cow_copies": stats.cow_copies, "evictions": stats.evictions,
        "seconds": round(elapsed, 2), "processes": args.processes,
        "spawned": len(children), "overcommit": args.overcommit,
        "demand_per_process": demand, "block_size": args.block_size,
        "max_blocks": args.max_blocks, "seed": args.seed, "pool": m.name,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.stress", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=4, help="stress processes (default 4)")
    ap.add_argument("--seconds", type=float, default=10.0, help="run time (default 10)")
    ap.add_argument("--kill-every", type=float, default=0.0, metavar="SECONDS",
                    help="SIGKILL a random process this often and start a new one (0: never)")
    ap.add_argument("--kill-waiters", action="store_true",
                    help="with --kill-every: prefer a process asleep on the pool lock, so that "
                         "waiters are killed as well as holders")
    ap.add_argument("--overcommit", type=float, default=1.0, metavar="X",
                    help="processes together ask for X times the pool's blocks (default 1)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-blocks", type=int, default=256)
    ap.add_argument("--json", metavar="PATH", help="write the report there")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--name", help="pool name (default stress-<pid>)")
    ap.add_argument("--reserve", type=int, default=0, metavar="N",
                    help="each worker keeps a reserve of N freed blocks (set_reserve; default 0)")
    for a in ("--worker", "--result", "--demand", "--prompt-seed", "--parent"):
        ap.add_argument(a, help=argparse.SUPPRESS,
                        type=str if a in ("--worker", "--result") else int)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    if (args.processes < 1 or args.seconds <= 0 or args.overcommit <= 0 or args.kill_every < 0
            or args.reserve < 0):
        print("stress: --processes, --seconds and --overcommit must be positive, --reserve "
              "not negative", file=sys.stderr)
        return 2
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())

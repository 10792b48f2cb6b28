"""What the workers' step logs say: steps grouped by rows and BLAS threads.

    python -m tools.bench.step_logs [--timeline] DIR [DIR ...]

Each DIR holds the ``engine-PID.log`` files of one server run, as
``SHMCACHE_STEP_TIMING=DIR`` writes them (``workers/worker/step_timing.py``;
``STEP_LOGS=1 bash tools/device_bench.sh ...`` packs them into one file).
For each DIR it prints the workers, the span of the logs and the engine's
busy time, then the median and p90 of:

* decode steps that admitted nothing (rows before = rows after), by (rows,
  BLAS threads): what a decode step costs at each batch size and thread count;
* steps that computed prompt tokens (a prefill chunk or a batched
  admission), by BLAS threads, and how many of them had running rows (a
  pause in those rows' replies).

It answers the questions decisions 0015 and 0019 needed answered: does a
lent thread speed a decode step up, how often is a decoding worker's row
held back by a prefill, how full are the batches.

``--timeline`` prints, instead, each worker's steps in time order on one
line (seconds from the first busy step of the folder): a prefill step as
``P<start>+<seconds>[rows before>after]t<threads>``, and a run of decode
steps with the same rows and threads, each starting within 0.15 s of the
last one's end, as ``D<start>-<end>r<rows>x<steps>t<threads>``. It shows
what the grouping hides: which worker waited, and for what (decision 0015's
amendment of 2026-12-06 read the turn-1 stagger from it).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys

LINE = re.compile(r"(?P<end>\S+) total=(?P<ms>\S+) gap=\S+ rows=(?P<r0>\d+)->(?P<r1>\d+) "
                  r"threads=(?P<threads>\d+)(?P<rest>.*)")
PREFILL = ("_forward_chunk=", "_prefill_group=")


def parse(path: str) -> list[dict]:
    """The steps of one log: end (s), ms, rows before and after, threads, and
    what kind of step it was ("decode", "prefill" or "idle")."""
    out = []
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m is None:
                continue
            rest = m["rest"]
            kind = "prefill" if any(k in rest for k in PREFILL) else \
                "decode" if "_decode=" in rest else "idle"
            out.append({"end": float(m["end"]), "ms": float(m["ms"]), "rows": int(m["r0"]),
                        "rows_after": int(m["r1"]), "threads": int(m["threads"]), "kind": kind})
    return out


def _logs(run_dir: str) -> list:
    """The ``engine-PID.log`` files of ``run_dir``, by name."""
    return sorted(f for f in os.listdir(run_dir) if re.fullmatch(r"engine-\d+\.log", f))


def summarize(run_dir: str) -> dict:
    logs = _logs(run_dir)
    steps = [s for f in logs for s in parse(os.path.join(run_dir, f))]
    groups: dict = collections.defaultdict(list)
    held = 0
    for s in steps:
        if s["kind"] == "decode" and s["rows"] == s["rows_after"]:
            groups[("decode", s["rows"], s["threads"])].append(s["ms"])
        elif s["kind"] == "prefill":
            groups[("prefill", s["threads"])].append(s["ms"])
            held += s["rows"] > 0
    ends = [s["end"] for s in steps]
    return {"workers": len(logs), "steps": len(steps),
            "span_s": (max(ends) - min(ends)) if ends else 0.0,
            "busy_s": sum(s["ms"] for s in steps if s["kind"] != "idle") / 1000,
            "prefill_with_rows": held, "groups": dict(groups)}


def timeline(run_dir: str, gap_s: float = 0.15) -> dict:
    """Each log's steps in time order, compressed as ``--timeline`` prints
    them: {worker pid: [event, ...]}."""
    logs = _logs(run_dir)
    per = {f[len("engine-"):-len(".log")]: [s for s in parse(os.path.join(run_dir, f))
                                           if s["kind"] != "idle"] for f in logs}
    starts = [s["end"] - s["ms"] / 1000 for v in per.values() for s in v]
    t0 = min(starts) if starts else 0.0
    out = {}
    for pid, steps in per.items():
        events: list = []
        run = None                                   # [start, end, rows, steps, threads]
        for s in steps:
            start, end = s["end"] - s["ms"] / 1000 - t0, s["end"] - t0
            if s["kind"] == "decode" and run is not None and start - run[1] < gap_s \
                    and (s["rows"], s["threads"]) == (run[2], run[4]):
                run[1], run[3] = end, run[3] + 1
                continue
            if run is not None:
                events.append(_decode_run(run))
                run = None
            if s["kind"] == "decode":
                run = [start, end, s["rows"], 1, s["threads"]]
            else:
                events.append(f"P{start:.2f}+{s['ms'] / 1000:.2f}"
                              f"[{s['rows']}>{s['rows_after']}]t{s['threads']}")
        if run is not None:
            events.append(_decode_run(run))
        out[pid] = events
    return out


def _decode_run(run: list) -> str:
    start, end, rows, steps, threads = run
    return f"D{start:.2f}-{end:.2f}r{rows}x{steps}t{threads}"


def _p90(v: list) -> float:
    return sorted(v)[min(len(v) - 1, int(len(v) * 0.9))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.step_logs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", metavar="DIR", help="a folder of engine-PID.log files")
    ap.add_argument("--timeline", action="store_true",
                    help="each worker's steps in time order, one line per worker")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if not os.path.isdir(d):
            print(f"step_logs: {d}: not a folder", file=sys.stderr)
            return 2
    for d in args.dirs:
        if args.timeline:
            print(f"{d}: seconds from the first busy step")
            for pid, events in timeline(d).items():
                print(f"  {pid} " + " ".join(events))
            continue
        r = summarize(d)
        print(f"{d}: {r['workers']} workers, {r['steps']} steps over {r['span_s']:.1f} s, "
              f"engines busy {r['busy_s']:.1f} s; {r['prefill_with_rows']} prefill steps "
              "held running rows")
        print("  step | rows | threads | n | median ms | p90 ms")
        for key in sorted(r["groups"], key=lambda k: (k[0], k[1] if len(k) == 3 else 0, k[-1])):
            v = r["groups"][key]
            rows = str(key[1]) if key[0] == "decode" else "-"
            print(f"  {key[0]} | {rows} | {key[-1]} | {len(v)} | {statistics.median(v):.1f} | "
                  f"{_p90(v):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``make bench``: run the benchmark sections and print one table.

Each section is a module with ``run(args) -> list[dict]`` (rows made with
:func:`tools.bench.table.row`) and, optionally, ``add_args(parser)`` for its own options. To
add one, append ``(name, module)`` to ``SECTIONS``; it is imported only when
it runs, so a section whose dependencies are missing fails alone.

    python -m tools.bench                 # every section
    python -m tools.bench --only pool     # some sections
    python -m tools.bench --json out.json # also write the rows as JSON

A benchmark, not a test: unmet targets are reported (``met?`` = no) but do
not change the exit status; a section that crashes does (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import traceback

from tools.bench.table import print_table

# (section name, module): run in this order.
SECTIONS = [
    ("pool", "tools.bench.pool"),
    ("workers", "tools.bench.workers"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the rows (and machine info) as JSON")
    ap.add_argument("--only", metavar="NAME", action="append",
                    help=f"run only these sections (of {', '.join(n for n, _ in SECTIONS)})")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter trials (noisier)")
    only = ap.parse_known_args(argv)[0].only
    unknown = set(only or ()) - {n for n, _ in SECTIONS}
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}")
    mods = []
    for name, modname in SECTIONS:
        if only and name not in only:
            continue
        try:
            mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - a section that cannot load fails alone
            mods.append((name, None, traceback.format_exc()))
            continue
        if hasattr(mod, "add_args"):
            mod.add_args(ap.add_argument_group(f"section {name}"))
        mods.append((name, mod, None))
    args = ap.parse_args(argv)

    rows, failed = [], []
    t_all = time.perf_counter()
    load0 = _load()
    for name, mod, err in mods:
        t0 = time.perf_counter()
        print(f"[bench] section {name} ...", file=sys.stderr, flush=True)
        if mod is None:
            failed.append(name)
            print(f"[bench] section {name} could not be imported:\n{err}", file=sys.stderr)
            continue
        try:
            got = mod.run(args)
        except Exception:  # noqa: BLE001 - a section that crashes fails alone
            failed.append(name)
            print(f"[bench] section {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
            continue
        for r in got:
            r["section"] = r.get("section") or name
        rows.extend(got)
        print(f"[bench] section {name} done in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)

    print()
    print_table(rows)
    total = time.perf_counter() - t_all
    load1 = _load()
    print(f"\n{len(rows)} rows in {total:.1f} s; python {platform.python_version()}, "
          f"{platform.machine()}, {_cpus()} cpus; load average {load0:.2f} before, {load1:.2f} after"
          + (f"; FAILED sections: {failed}" if failed else ""))
    if max(load0, load1) > 0.5 * _cpus():
        print("warning: other processes were using the CPUs; the figures are noisy "
              "(run again on a quiet machine)")
    if args.json:
        doc = {"rows": rows, "failed_sections": failed, "seconds": total,
               "load_average": [load0, load1],
               "python": platform.python_version(), "machine": platform.machine(),
               "cpus": _cpus(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 1 if failed else 0


def _load() -> float:
    import os
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _cpus() -> int:
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``shmcache`` command: look at, check and clean up pools in /dev/shm.

    shmcache list                    every pool: owner, alive, size, usage
    shmcache inspect NAME [--json]   one pool's statistics, layout and holders
    shmcache top NAME [--interval S] the same, refreshed in place until Ctrl-C
    shmcache fsck NAME [--repair]    invariant check (exit 1 on violations)
    shmcache cleanup [NAME|PATTERN]  remove pools whose owner is dead and that
                                     no live process has attached
    shmcache doctor [--json]         BLAS in use, matmul GFLOP/s, versions, /dev/shm, CPUs
    shmcache serve [--model PATH]    an OpenAI-compatible HTTP server (serve --help)
    shmcache convert FILE.gguf DIR [--quantized]
                                     a llama/qwen2 GGUF file as an mlx-lm model directory

Exit codes: 0 success; 1 fsck found violations (left after ``--repair``) or a
named ``cleanup`` kept a live pool; 2 an error (unknown pool, not a pool, an
incompatible layout version, a corrupt header, a segment another user owns or
can write, bad arguments), reported in one line on stderr.
``top`` exits 0 on Ctrl-C. ``list``, ``inspect`` and ``top`` take no slot and
change nothing; ``fsck`` checks a private copy of the read-only mapped
metadata and changes nothing, not even the lock word; ``fsck --repair``
attaches (taking a slot until it exits) and repairs.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import signal
import sys
import time

from .shm import segment
from .errors import ShmCacheError
from .pool.inspect_pool import PoolView, cleanup as cleanup_pool

BAR_WIDTH = 40


class CliError(Exception):
    pass


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def usage_bar(frac: float, width: int = BAR_WIDTH) -> str:
    frac = min(max(frac, 0.0), 1.0)
    full = round(frac * width)
    return "[" + "#" * full + "." * (width - full) + f"] {100 * frac:5.1f}%"


def _open(name: str) -> PoolView:
    segment.check_name(name)
    return PoolView(name)


# ------------------------------------------------------------------- list
def cmd_list(args) -> int:
    names = segment.list_names()
    if not names:
        print(f"no shmcache pools in {segment.SHM_DIR}")
        return 0
    rows = []
    for n in names:
        try:
            with PoolView(n, require_ready=False) as v:
                d = v.summary()
        except (ShmCacheError, OSError, ValueError) as e:
            rows.append((n, "-", "-", "-", "-", human_bytes(_size(n)), f"not usable: {e}"))
            continue
        alive = "yes" if d["owner_alive"] else "DEAD"
        if "max_blocks" not in d:
            rows.append((n, str(d["owner_pid"]), alive, "-", "-", human_bytes(d["size_bytes"]),
                         "initialising" if d.get("creating") else
                         "never initialised (its creator died creating it)"))
            continue
        rows.append((n, str(d["owner_pid"]), alive, str(d["attached"]), str(d["max_blocks"]),
                     human_bytes(d["size_bytes"]),
                     f"{d['allocated_blocks']}/{d['max_blocks']} {usage_bar(d['usage'], 20)}, "
                     f"{d['cached_blocks']} cached"))
    head = ("NAME", "OWNER", "ALIVE", "ATTACHED", "BLOCKS", "BYTES", "USAGE")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(6)]
    for r in [head] + rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r[:6])) + "  " + r[6])
    return 0


def _size(name: str) -> int:
    try:
        import os
        return os.stat(segment.path_for(name)).st_size
    except OSError:
        return 0


# ---------------------------------------------------------------- inspect
def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def render(d: dict) -> str:
    lay = d["layout"]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["created_at"]))
    lines = [
        f"pool {d['name']}  ({d['path']}, {human_bytes(d['size_bytes'])})",
        f"owner     pid {d['owner_pid']} ({'alive' if d['owner_alive'] else 'dead'}), "
        f"created {when}",
        f"layout    block_size {lay['block_size']}, max_blocks {lay['max_blocks']}, "
        f"{lay['num_layers']} layers x {lay['num_kv_heads']} kv heads x head_dim "
        f"{lay['head_dim']} {lay['dtype']} ({human_bytes(lay['block_bytes'])}/block), "
        f"caching {'on' if lay['enable_caching'] else 'off'}",
        f"          slots {lay['max_slots']}, tables {lay['max_tables']}, refs {lay['max_refs']}, "
        f"metadata {human_bytes(lay['arena_off'])}, kv arena {human_bytes(lay['arena_size'])}",
        f"usage     {usage_bar(d['usage'])}",
        f"blocks    used {d['blocks_used']}, cached {d['blocks_cached']}, free "
        f"{d['blocks_free']} (holding nothing; as /metrics counts them)",
        f"          allocated {d['allocated_blocks']}, on the free list {d['free_blocks']}, "
        f"shared {d['shared_blocks']}, "
        f"tokens held {d['tokens_held']} (seed's count {d['total_tokens_cached']})",
        f"capacity  references {d['refs_held']}/{d['max_refs']} "
        f"({_pct(d['refs_held'], d['max_refs'])}), block tables "
        f"{d['block_tables']}/{d['max_tables']}, attached {d['attached']}/{d['max_slots']}",
        f"cache     hits {d['cache_hits']}, misses {d['cache_misses']}, prefix hit rate "
        f"{100 * d['prefix_hit_rate']:.1f}%, cow copies {d['cow_copies']}, "
        f"evictions {d['evictions']}",
        f"pool      tables {d['block_tables']}, lock holds {d['ops']}, max lock wait "
        f"{d['max_lock_wait_s'] * 1e3:.3f} ms, turns {d['lock_turns']} "
        f"({d['lock_queue']} waiting), recoveries {d['recoveries']}, reclaimed refs "
        f"{d['reclaimed_refs']}{', DIRTY' if d['dirty'] else ''}"
        f"{'' if d['consistent_snapshot'] else ' (lock busy: unlocked snapshot)'}",
    ]
    lo = d.get("lock_owner")
    if lo:
        lines.append(f"lock      held by thread {lo['tid']}"
                     + (f" of pid {lo['pid']}" if lo["pid"] else " (no such thread)")
                     + (f": NO HOLD: {lo['problem']}" if lo["problem"] else ""))
    lines += render_l2(d.get("l2") or {})
    hs = d["holders"]
    if not hs:
        lines.append("holders   none attached")
    else:
        lines.append(f"holders   {'slot':>4}  {'pid':>8}  {'alive':5}  {'tables':>6}  "
                     f"{'table blocks':>12}  {'loose blocks':>12}  {'reserved':>8}")
        for h in hs:
            lines.append(f"          {h['slot']:>4}  {h['pid']:>8}  "
                         f"{'yes' if h['alive'] else 'DEAD':5}  {h['tables']:>6}  "
                         f"{h['table_blocks']:>12}  {h['loose_blocks']:>12}  "
                         f"{h.get('reserved_blocks', 0):>8}")
    return "\n".join(lines)


def render_l2(c: dict) -> list:
    """The L2 section: only when some process of the pool used an L2 tier
    (a counter is not zero)."""
    if not any(c.values()):
        return []
    looked = c["hits"] + c["misses"]
    return [
        f"L2        lookups {c['lookups']}, blocks hit {c['hits']}, missed {c['misses']} "
        f"(hit rate {_pct(c['hits'], looked)}), read {human_bytes(c['read_bytes'])}, "
        f"rejected {c['rejected']}",
        f"          blocks written {c['writes']} ({human_bytes(c['written_bytes'])}), "
        f"dropped {c['dropped']}; timeouts {c['timeouts']}, errors {c['errors']}, "
        f"outages {c['outages']}",
    ]


def cmd_inspect(args) -> int:
    with _open(args.name) as v:
        d = v.snapshot()
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=False))
    else:
        print(render(d))
    return 0


# -------------------------------------------------------------------- top
def cmd_top(args) -> int:
    _open(args.name).close()          # fail fast on a bad name
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even as a background job
    out = sys.stdout
    try:
        while True:
            try:
                with _open(args.name) as v:
                    d = v.snapshot()
            except ShmCacheError as e:
                out.write("\n")
                raise CliError(f"pool {args.name!r} went away: {e}") from None
            stamp = time.strftime("%H:%M:%S")
            out.write("\x1b[H\x1b[2J" + f"shmcache top {args.name}   {stamp}   "
                      f"(every {args.interval:g} s, Ctrl-C to quit)\n\n" + render(d) + "\n")
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        return 0


# ------------------------------------------------------------------- fsck
def _fsck_read_only(name: str) -> int:
    # No slot, no lock, no recovery: the check runs on a private copy of the
    # read-only mapped metadata (PoolView.fsck), so not one byte changes.
    with _open(name) as v:
        r = v.fsck()
    problems, s = r["problems"], r["stats"]
    if r["dirty"]:
        print(f"{name}: marked dirty (a lock holder died mid-update, or is inside one): its "
              f"next lock holder rebuilds the derived state; 'shmcache fsck --repair {name}' "
              "does it now")
    if not r["stable"]:
        print(f"{name}: the pool kept changing: this check is of a copy taken mid-operation")
    for line in problems:
        print(f"{name}: {line}")
    if problems:
        print(f"{name}: {len(problems)} violation(s); run 'shmcache fsck --repair {name}'",
              file=sys.stderr)
        return 1
    dead = [h for h in r["holders"] if not h["alive"]]
    print(f"{name}: consistent: {s['total_blocks']} blocks, {s['allocated_blocks']} "
          f"allocated, {s['free_blocks']} free, {r['tables']} tables, "
          f"{len(r['holders'])} attached managers"
          + (f" ({len(dead)} dead, holding {_held(dead)} references: "
             "--repair releases them)" if dead else ""))
    return 0


def cmd_fsck(args) -> int:
    import shmcache
    from .pool import recovery
    if not args.repair:
        return _fsck_read_only(args.name)
    with _open(args.name) as v:
        dirty = bool(v.counters.dirty)
    mgr = shmcache.attach(args.name, timeout=1.0)
    try:
        p = mgr.pool
        problems = mgr.check()
        if dirty:
            print(f"{args.name}: was marked dirty (a lock holder died mid-update); "
                  "it was rebuilt on first lock")
        dead = [h for h in mgr.holdings() if not h["alive"]]
        for line in problems:
            print(f"{args.name}: found: {line}")
        before = recovery.scan_stats(p)
        chunks_before = int(p.counters.free_refs)
        with p.lock:
            if problems:
                recovery.repair(p)      # (the manager re-reads its lists: the epoch moved)
            released = mgr.reclaim_dead()
        after = recovery.scan_stats(p)
        print(f"{args.name}: repair: {'rebuilt derived state; ' if problems else ''}"
              f"released {released} references of {len(dead)} dead holder(s); "
              f"free blocks {before['free_blocks']} -> {after['free_blocks']}, allocated "
              f"{before['allocated_blocks']} -> {after['allocated_blocks']}, references "
              f"held {before['refs_held']} -> {after['refs_held']} of {after['max_refs']}, "
              f"free reference chunks {chunks_before} -> {int(p.counters.free_refs)}")
        left = mgr.check()
        for line in left:
            print(f"{args.name}: still: {line}")
        if left:
            return 1
        print(f"{args.name}: consistent after repair")
        return 0
    finally:
        mgr.close()


def _held(holders) -> int:
    return sum(h["table_blocks"] + h["loose_blocks"] for h in holders)


# ---------------------------------------------------------------- cleanup
def cmd_cleanup(args) -> int:
    pattern = args.name or "*"
    is_glob = any(ch in pattern for ch in "*?[")
    if is_glob:
        names = [n for n in segment.list_names() if fnmatch.fnmatchcase(n, pattern)]
    else:
        segment.check_name(pattern)
        names = [pattern]
    removed = kept = 0
    for n in names:
        try:
            ok, why = cleanup_pool(n)
        except ShmCacheError as e:
            if not is_glob:
                raise
            print(f"skipped {n}: {e}")
            continue
        if ok:
            removed += 1
            print(f"removed {segment.path_for(n)}: {why}")
        else:
            kept += 1
            print(f"kept {n}: {why}")
    if not removed:
        print("nothing removed" + (f" ({kept} pool(s) in use)" if kept else ""))
    return 1 if (kept and not is_glob) else 0


# ----------------------------------------------------------------- doctor
def cmd_doctor(args) -> int:
    from .doctor import run
    return run(as_json=args.json, measure=not args.no_measure)


# ------------------------------------------------------------------ serve
def cmd_serve(args) -> int:
    from .server.main import run       # uvicorn, FastAPI and MLX load for serve only
    return run(args)


# ---------------------------------------------------------------- convert
def cmd_convert(args) -> int:
    import os
    from .models.gguf import convert
    if not args.gguf.lower().endswith(".gguf") or not os.path.isfile(args.gguf):
        raise CliError(f"{args.gguf}: not a .gguf file")
    if os.path.exists(args.dir) and (not os.path.isdir(args.dir) or os.listdir(args.dir)):
        raise CliError(f"{args.dir}: exists and is not an empty directory")
    convert(args.gguf, args.dir, quantized=args.quantized)
    return 0


def version() -> str:
    """shmcache's version: the installed distribution's (pyproject.toml's), else
    the package's ``__version__``, else "unknown" (a checkout never installed)."""
    from importlib import metadata
    try:
        return metadata.version("shmcache")
    except metadata.PackageNotFoundError:
        return getattr(sys.modules[__package__], "__version__", "unknown")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line (what was wrong,
    and where the help is) and exit 2, not the usage block before it
    (``serve``'s alone is a dozen lines). ``commands``: each command's
    parser by name (``build_parser`` fills it)."""

    commands: dict

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> _Parser:
    ap = _Parser(
        prog="shmcache",
        description="Serve a language model from several worker processes that share one KV "
                    "cache in shared memory (serve), and inspect, check and clean up the "
                    "shmcache pools in /dev/shm.",
        epilog="Exit codes: 0 ok, 1 violations (fsck) or a kept pool (cleanup NAME), 2 error.")
    ap.add_argument("--version", action="version", version=f"shmcache {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)
    ap.commands = sub.choices

    def add(name: str, help: str, description: str = ""):
        # the one-line help in `shmcache --help`, and a description in `shmcache NAME --help`
        return sub.add_parser(name, help=help, description=description or help[0].upper()
                              + help[1:] + ".")
    add("list", "every pool: owner, alive, size, usage",
        "List every shmcache pool in /dev/shm: its owner's pid and whether it is alive, the "
        "processes attached, its blocks, size and usage: the blocks in use (referenced) out "
        "of all, and the blocks cached (published prefixes no one references, reusable "
        "until evicted: they count as free).")
    p = add("inspect", "one pool's statistics, layout and holders",
            "One pool's statistics (blocks free, used and cached, the prefix-cache hit rate), "
            "its layout, and what each attached process holds. Read-only.")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = add("top", "inspect, refreshed in place until Ctrl-C")
    p.add_argument("name")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p = add("fsck", "check the pool's invariants",
            "Check the pool's invariants (exit 1 if one is violated); --repair rebuilds "
            "derived state and releases what dead processes held.")
    p.add_argument("name")
    p.add_argument("--repair", action="store_true",
                   help="rebuild derived state and release dead holders' references")
    p = add("cleanup", "remove pools whose owner is dead and nobody attached",
            "Remove the pools whose owner (pid and start time; a zombie counts as dead) is "
            "dead and that no live process is attached to. A live pool is never removed.")
    p.add_argument("name", nargs="?", help="a pool name or shell pattern (default: all)")
    p = add("doctor", "BLAS in use, matmul GFLOP/s, versions, /dev/shm, CPUs",
            "What this machine gives a shmcache worker: the BLAS MLX uses and a measured "
            "matmul, versions, /dev/shm's size and free space (with a warning when it is "
            "small), the CPUs.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-measure", action="store_true", help="skip the matmul measurement")
    p = sub.add_parser("convert", help="a llama/qwen2 GGUF file as an mlx-lm model directory",
                       description="Convert a llama or qwen2 GGUF file (F32, F16, Q4_0, Q4_1, "
                       "Q8_0 tensors, byte-level BPE tokenizer) into an mlx-lm model directory. "
                       "Weights become float32 (MLX's CPU backend is fast only in float32); "
                       "--quantized keeps the file's 4/8-bit weights (less memory, slower).")
    p.add_argument("gguf", metavar="FILE.gguf")
    p.add_argument("dir", metavar="DIR", help="the new directory (must not exist, or be empty)")
    p.add_argument("--quantized", action="store_true",
                   help="keep Q4_0/Q4_1/Q8_0 weights quantized (default: float32)")
    from .server import main as serve_main
    serve_main.add_arguments(sub.add_parser("serve", help=serve_main.HELP))
    return ap


COMMANDS = {"list": cmd_list, "inspect": cmd_inspect, "top": cmd_top, "fsck": cmd_fsck,
            "cleanup": cmd_cleanup, "doctor": cmd_doctor, "serve": cmd_serve,
            "convert": cmd_convert}


def main(argv=None) -> int:
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:                        # said by the command's parser: "shmcache serve: error: ..."
        ap.commands[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        return 130
    except (CliError, ShmCacheError, ValueError, OSError) as e:
        print(f"shmcache {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

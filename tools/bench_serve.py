"""Serve one workload three ways and compare: ``shmcache serve`` against mlx_lm.server.

Configurations (``--only`` picks some, comma-separated):

    a            shmcache serve --workers N (its workers share one KV cache in /dev/shm)
    b            mlx_lm.server, one process, its own prompt cache, BLAS as installed
                 (the mlx wheel's reference BLAS)
    b-sameblas   b with the optimized BLAS that shmcache binds (LD_PRELOAD=<lib>,
                 OPENBLAS_NUM_THREADS=1)
    c            N separate mlx_lm.server processes, the client sends request i to
                 server i mod N (round-robin), BLAS as installed
    c-sameblas   c with the same BLAS as shmcache

Each configuration, each round: start the server(s) as subprocesses on free
ports, wait for /health, warm up (one short unrelated request per process
that generates: N concurrent ones for a, one per server for c), then run the
workload and stop the server(s) (SIGTERM, then SIGKILL of the process group),
and check that nothing of theirs is left in /dev/shm. The rounds interleave
the configurations (a, b, b-sameblas, c, c-sameblas, then again), so that a
drift of the machine's load touches them all alike.

The workload (the same text for every configuration, seeded): a shared
system prompt of ``--system-chars`` printable ASCII characters followed by a
user turn of 24 to 159 characters; every ``--unique-every``-th request
instead has a prompt of the same length that shares no prefix (a unique
prompt). Requests are text completions (``/v1/completions``, temperature 0,
``max_tokens``, streamed), so every server tokenizes them identically. The
first request is a shared-prefix one and runs alone (it computes the prefix
that the others then find cached); the rest are sent from ``--concurrency``
client threads.

Figures (per configuration and round; the table shows min-max over rounds):

    throughput   generated tokens (usage.completion_tokens) / wall seconds of
                 the whole workload, first request included
    TTFT         client-side time from sending the request to the first
                 streamed text: p50/p90 of the shared-prefix requests after
                 the first ("cached") and of the unique ones
    PSS          summed proportional set size (psutil) of the server
                 processes and all their children, at the end of the run
    ratios       (a) / other, paired round by round; the targets (2 workers
                 on a 2-core machine: throughput >= 1.5x, cached TTFT p50 <=
                 0.2x) are checked against b-sameblas

    python -m tools.bench_serve --workers 2 --requests 24 --rounds 2
    python -m tools.bench_serve --only a,b-sameblas --json out.json

A benchmark, not a test: unmet targets do not change the exit status; a
configuration that fails (a server that does not start, a request that
errors, a segment left in /dev/shm) does (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

# the names other tools import from here (tools.bench_l2) stay importable
from tools.bench_serve_client import (ALPHABET, Req, build_workload,  # noqa: F401
                                      figures, one_request, pct, run_workload,
                                      warmup_prompts)
from tools.bench_serve_procs import (SHM_DIR, Server, _shm_entries, free_port,  # noqa: F401
                                     log, tree_pss)
from tools.bench_serve_report import (METRICS, RATIOS, TARGETS, _ms, _span,  # noqa: F401
                                      _table, report, summarize)

CONFIGS = ("a", "b", "b-sameblas", "c", "c-sameblas")


# ------------------------------------------------------------------ configurations
@dataclass
class Config:
    name: str
    label: str
    kind: str                    # "shmcache" or "mlx"
    servers: int                 # processes to start
    warmups: int                 # warm-up requests (sent concurrently)
    env: dict = field(default_factory=dict)


def make_configs(workers: int, blas_path: Optional[str]) -> dict[str, Config]:
    same = {"LD_PRELOAD": blas_path, "OPENBLAS_NUM_THREADS": "1"} if blas_path else None
    out = {
        "a": Config("a", f"shmcache serve, {workers} workers", "shmcache", 1, workers),
        "b": Config("b", "mlx_lm.server, BLAS as installed", "mlx", 1, 1),
        "c": Config("c", f"{workers} x mlx_lm.server round-robin, BLAS as installed", "mlx",
                    workers, 1),
    }
    if same:
        out["b-sameblas"] = Config("b-sameblas", "mlx_lm.server, same BLAS as shmcache", "mlx",
                                   1, 1, dict(same))
        out["c-sameblas"] = Config("c-sameblas",
                                   f"{workers} x mlx_lm.server round-robin, same BLAS", "mlx",
                                   workers, 1, dict(same))
    return out


def server_argv(cfg: Config, model: str, port: int, args) -> list[str]:
    if cfg.kind == "shmcache":
        return [sys.executable, "-m", "shmcache.cli", "serve", "--model", model,
                "--workers", str(args.workers), "--port", str(port), "--log-level", "warning"]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port),
            "--prompt-cache-size", str(args.prompt_cache_size), "--log-level", "WARNING"]


def run_config(cfg: Config, args, reqs: list[Req], logdir: str, rnd: int) -> dict:
    """Start, warm up, run, measure, stop. Returns the round's record."""
    rec: dict = {"config": cfg.name, "round": rnd}
    servers = []
    shm_before = _shm_entries()
    client = httpx.Client(trust_env=False,
                          limits=httpx.Limits(max_connections=args.concurrency + 8,
                                              max_keepalive_connections=args.concurrency + 8))
    try:
        for k in range(cfg.servers):
            port = free_port()
            servers.append(Server(f"{cfg.name}-{k}", server_argv(cfg, args.model, port, args),
                                  cfg.env, port, logdir))
        rec["commands"] = [s.command() for s in servers]
        t0 = time.perf_counter()
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(client, args.startup_timeout,
                         workers=args.workers if cfg.kind == "shmcache" else 1)
        rec["startup_s"] = time.perf_counter() - t0
        # warm-up: every process that generates tokens runs one short request
        prompts = warmup_prompts(cfg.warmups * len(servers), args.seed)
        errs: list[str] = []

        def warm(j: int) -> None:
            try:
                one_request(client, servers[j % len(servers)].url, prompts[j], args.max_tokens,
                            args.request_timeout)
            except Exception as e:  # noqa: BLE001
                errs.append(f"{type(e).__name__}: {e}")
        ts = [threading.Thread(target=warm, args=(j,)) for j in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise RuntimeError(f"warm-up failed: {errs[0]}")
        for s in servers:
            s.observe()
        rec["blas"] = sorted({b for s in servers for b in s.blas()})
        log(f"  ready in {rec['startup_s']:.1f} s, warmed up; BLAS mapped: "
            f"{', '.join(rec['blas']) or 'none found'}; running {len(reqs)} requests")
        records, wall = run_workload(client, [s.url for s in servers], reqs, args.concurrency,
                                     args.max_tokens, args.request_timeout)
        for s in servers:
            s.observe()
        rec["pss_bytes"] = tree_pss([s.proc.pid for s in servers])
        rec.update(figures(records, wall))
        rec["request_records"] = records
        first_err = next((r["error"] for r in records if "error" in r), None)
        if first_err:
            rec["error"] = f"{rec['errors']} request(s) failed, e.g. {first_err}"
    except Exception as e:  # noqa: BLE001 - the configuration fails alone
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        client.close()
        rec["exit_codes"] = [s.stop() for s in servers]
    # the leak check: files its processes mapped, a pool named after one of
    # them, or anything new in /dev/shm that names one of its pids
    pids = {p for s in servers for p in s.pids}
    mapped = {p for s in servers for p in s.shm_paths}
    left = []
    for name in sorted(_shm_entries() - shm_before):
        path = os.path.join(SHM_DIR, name)
        if path in mapped or any(re.search(rf"(?<!\d){pid}(?!\d)", name) for pid in pids):
            left.append(path)
    left += sorted(p for p in mapped if os.path.exists(p) and p not in left
                   and os.path.basename(p) not in shm_before)
    rec["shm_left"] = left
    rec["server_pids"] = sorted(pids)
    for path in left:
        try:
            os.unlink(path)
        except OSError:
            pass
    if left:
        rec.setdefault("error", f"left in /dev/shm: {', '.join(left)} (removed)")
    return rec


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2,
                    help="shmcache workers (a) and mlx_lm.server processes (c) (default 2)")
    ap.add_argument("--requests", type=int, default=24, help="requests per run (default 24)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the configurations")
    ap.add_argument("--model", metavar="DIR", help="model directory (default: the demo model)")
    ap.add_argument("--only", metavar="LIST",
                    help=f"comma-separated configurations, of {','.join(CONFIGS)} (default all)")
    ap.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    ap.add_argument("--max-tokens", type=int, default=24, help="max_tokens per request")
    ap.add_argument("--system-chars", type=int, default=1000,
                    help="length of the shared system prompt (characters; default 1000)")
    ap.add_argument("--unique-every", type=int, default=4,
                    help="every k-th request is a unique prompt (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-cache-size", type=int, default=10,
                    help="mlx_lm.server --prompt-cache-size (default 10, its own default)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.requests < 2 or args.rounds < 1 or args.concurrency < 1:
        ap.error("need --workers >= 1, --requests >= 2, --rounds >= 1, --concurrency >= 1")
    only = [c.strip() for c in args.only.split(",") if c.strip()] if args.only else list(CONFIGS)
    unknown = [c for c in only if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {','.join(CONFIGS)}")
    bench_cmd = shlex.join([sys.executable, "-m", "tools.bench_serve"] +
                           list(sys.argv[1:] if argv is None else argv))

    import shmcache.blas as blas             # stdlib only: does not load mlx here
    from shmcache.demo_model import ensure_demo_model
    if args.model is None:
        args.model = str(ensure_demo_model())
    bi = blas.info()
    blas_path = bi.path if bi.optimized and bi.path else next(iter(blas.candidates()), None)
    configs = make_configs(args.workers, blas_path)
    missing = [c for c in only if c not in configs]
    if missing:
        log(f"skipping {', '.join(missing)}: no optimized BLAS found for LD_PRELOAD "
            "(on Debian: apt-get install libopenblas0-pthread)")
    only = [c for c in only if c in configs]
    reqs = build_workload(args.requests, args.seed, args.system_chars, args.unique_every)
    log(f"model {args.model}; {len(reqs)} requests ({sum(q.shared for q in reqs)} with the "
        f"shared prefix, {sum(not q.shared for q in reqs)} unique), concurrency "
        f"{args.concurrency}, max_tokens {args.max_tokens}; same BLAS: {blas_path}")

    load0 = os.getloadavg()
    results: dict[str, list[dict]] = {c: [] for c in only}
    logdir = tempfile.mkdtemp(prefix="bench_serve-")
    t_all = time.perf_counter()
    try:
        for rnd in range(1, args.rounds + 1):
            for name in only:
                cfg = configs[name]
                log(f"round {rnd}/{args.rounds} {name} ({cfg.label}): starting")
                t0 = time.perf_counter()
                rec = run_config(cfg, args, reqs, logdir, rnd)
                results[name].append(rec)
                if "error" in rec:
                    log(f"  FAILED: {rec['error']}")
                else:
                    log(f"  {rec['throughput']:.1f} tok/s, TTFT cached p50 "
                        f"{_ms(rec['ttft_cached_p50'])} ms, unique p50 "
                        f"{_ms(rec['ttft_unique_p50'])} ms, PSS "
                        f"{rec['pss_bytes'] / 2**20:.0f} MiB, cached tokens per shared "
                        f"request {_span([rec['cached_tokens_shared']], lambda v: f'{v:.0f}')}"
                        f" ({time.perf_counter() - t0:.0f} s in all)")
    finally:
        if not args.keep_logs:
            for f in os.listdir(logdir):
                os.unlink(os.path.join(logdir, f))
            os.rmdir(logdir)
        else:
            log(f"server logs in {logdir}")

    summ = summarize(results)
    text = report(results, configs, summ, args, bench_cmd)
    print(text)
    failed = any("error" in r for rounds in results.values() for r in rounds)
    if args.json:
        out = {"command": bench_cmd, "args": vars(args),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version(), "loadavg_start": load0,
                           "loadavg_end": os.getloadavg()},
               "blas": {"shmcache": bi.as_dict(), "same_blas_preload": blas_path},
               "configs": {n: {"label": configs[n].label, "rounds": results[n]} for n in results},
               **summ, "elapsed_s": time.perf_counter() - t_all, "ok": not failed}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Serve workloads several ways, side by side: ``shmcache serve`` against mlx_lm.server.

Configurations (``--configs`` picks some, comma-separated; all on one BLAS,
Debian's OpenBLAS: shmcache binds it itself (shmcache.system.blas, one thread per
worker), mlx_lm.server gets it through LD_PRELOAD):

    a         shmcache serve --workers N (its workers share one KV cache in /dev/shm)
    b         one mlx_lm.server with its defaults: OpenBLAS with every core as a
              thread (OPENBLAS_NUM_THREADS unset), its own prompt cache
    c         N mlx_lm.server processes, OPENBLAS_NUM_THREADS=cores/N each; request k
              of a run goes to server k mod N (round-robin)
    c-sticky  the same N servers, every chat session pinned to one server
              (--sticky balanced: session s to server s mod N, a balancer that
              places new sessions round-robin and keeps them; --sticky hash:
              crc32 of the session's name mod N). Run on the chat workload only:
              elsewhere it is c.
    a-NAME    a with other flags, from --variant NAME=ARGS (repeatable): ARGS are
              more ``shmcache serve`` flags, led by any VAR=VALUE words that go
              into its environment (--variant pack8='--pack-rows 8' defines
              a-pack8); paired round by round with the rest, for an experiment
    llama     llama.cpp's server (llama_cpp.server) on the same GGUF file, every
              core as a thread, with --llama-cpp and --gguf (or a .gguf --model);
              skipped, with the reason printed, where llama_cpp does not import

Workloads (``--workloads``; tools.bench.serve_client has the details):

    shared    a shared system prompt of --system-chars characters, every
              --unique-every-th prompt unique instead; the first alone, then
              --concurrency client threads; --requests text completions
    unique    --requests prompts of the same lengths, no two sharing a prefix
    chat      --sessions S x --turns T over /v1/chat/completions, every turn
              resending the conversation so far with the previous reply; the
              sessions concurrently (or --chat-concurrency K at a time, each
              client thread taking the session that has waited longest), the
              turns of one session in order

Every round runs every workload on every configuration, interleaved (round 1:
shared on a, b, c; unique on a, b, c; chat on a, b, c, c-sticky; then round
2 ...), so a drift of the machine's load touches them all alike. Each run
starts its server(s) fresh on free ports, waits for them to be ready (with a
timeout), warms up every process that generates (one short request each),
runs the workload, and stops them (SIGTERM, then SIGKILL of each process
group), then checks that nothing of theirs is left in /dev/shm. Ctrl-C or a
SIGTERM stops every server before the benchmark exits.

Figures (per workload, configuration and round; the tables show min-max over
rounds):

    tok/s           generated tokens (usage.completion_tokens) / wall seconds of
                    the run
    TTFT            client-side time from sending a request to its first streamed
                    text, p50/p90, of cold requests (chat turn 1, unique prompts,
                    the first shared one) and warm ones (later chat turns,
                    shared-prefix requests after the first)
    ITL p99         the 99th percentile of the gaps between two streamed text
                    chunks of one reply (all replies of the run pooled)
    longest pause   per reply its longest such gap; the median over replies
    PSS             summed proportional set size (psutil) of all the
                    configuration's processes, sampled every --pss-interval
                    seconds during the run: the peak
    cores busy      CPU seconds of those processes during the run / its wall time
    ratios          (a) / other, paired round by round, with issue 26's targets

    python -m tools.bench.serve --model realistic:4 --workers 2 --rounds 2
    python -m tools.bench.serve --model demo --workloads chat --configs a,c,c-sticky \\
        --json out.json

A benchmark, not a test: unmet targets do not change the exit status; a run
that fails (a server that does not start, a request that errors, a segment
left in /dev/shm) does (exit 1). Bad arguments: exit 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Optional

import httpx

# the names other tools import from here (tools.bench.l2*) stay importable
from tools.bench.serve_client import (ALPHABET, WORKLOADS, Req, build_chat,  # noqa: F401
                                      build_workload, chat_request, figures, one_request, pct,
                                      run_chat, run_workload, sticky_server, warmup_prompts)
from tools.bench.serve_models import ModelError, resolve
from tools.bench.serve_procs import (SHM_DIR, PssSampler, Server, _shm_entries,  # noqa: F401
                                     free_port, log, stop_all, tree_cpu_seconds, tree_pss)
from tools.bench.serve_report import (TARGETS, _ms, _span, _table, report,  # noqa: F401
                                      summarize)

CONFIGS = ("a", "a-lend", "a-pt1", "a-pt4", "b", "c", "c-sticky", "llama")
DEFAULT_CONFIGS = ("a", "b", "c", "c-sticky")
#: Debian's libopenblas0-pthread: the BLAS every configuration runs on
DEBIAN_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS",
             "SHMCACHE_BLAS_THREADS")


# ------------------------------------------------------------------ configurations
@dataclass
class Config:
    name: str
    label: str
    kind: str                    # "shmcache", "mlx" or "llama"
    servers: int                 # processes to start
    warmups: int                 # warm-up requests per server (sent concurrently)
    route: str = "round-robin"   # how requests pick a server: "round-robin" or "sticky"
    env: dict = field(default_factory=dict)
    env_unset: tuple = ()
    workloads: tuple = WORKLOADS
    serve_args: tuple = ()       # more `shmcache serve` arguments (kind "shmcache")


def make_configs(workers: int, blas_path: str, sticky: str,
                 variants: Optional[dict[str, tuple[dict, tuple]]] = None
                 ) -> dict[str, Config]:
    cores = os.cpu_count() or 1
    # a's workers get the cores shared out as BLAS threads (its default); the
    # N servers of c get the same share each, so both use every core alike
    share = str(max(1, cores // workers))

    def shmcache(name: str, label: str, *serve_args: str, env: Optional[dict] = None
                 ) -> Config:
        return Config(name, label, "shmcache", 1, workers,
                      env={"SHMCACHE_BLAS": blas_path, **(env or {})},
                      env_unset=_BLAS_ENV, serve_args=serve_args)

    built_in = {
        "a": shmcache("a", f"shmcache serve --workers {workers} (OpenBLAS bound by shmcache, "
                      f"its default: {share} thread(s) per worker, idle workers' cores lent "
                      "where each has 2 CPUs or more)"),
        # the same with --lend-cores: lending where the default does not
        # (2 cores); on 16 cores with 8 workers it is (a)
        "a-lend": shmcache("a-lend", "a with --lend-cores (idle workers' cores lent to busy "
                           "ones)", "--lend-cores"),
        # a prefill's softmax and SiLU on 1 thread (as mlx-lm runs them), or 4
        "a-pt1": shmcache("a-pt1", "a with --prefill-threads 1 (a prefill's softmax and SiLU "
                          "on one thread, as mlx-lm runs them)", "--prefill-threads", "1"),
        "a-pt4": shmcache("a-pt4", "a with --prefill-threads 4", "--prefill-threads", "4"),
        "b": Config("b", f"1 x mlx_lm.server, its defaults: LD_PRELOAD OpenBLAS, "
                    f"OPENBLAS_NUM_THREADS unset ({cores} threads)", "mlx", 1, 1,
                    env={"LD_PRELOAD": blas_path}, env_unset=_BLAS_ENV),
        "c": Config("c", f"{workers} x mlx_lm.server, LD_PRELOAD OpenBLAS, "
                    f"OPENBLAS_NUM_THREADS={share} (the cores shared out), round-robin per "
                    "request", "mlx", workers, 1,
                    env={"LD_PRELOAD": blas_path, "OPENBLAS_NUM_THREADS": share},
                    env_unset=_BLAS_ENV),
        "c-sticky": Config("c-sticky", f"the {workers} servers of c, each chat session pinned "
                           f"to one ({sticky})", "mlx", workers, 1, route="sticky",
                           env={"LD_PRELOAD": blas_path, "OPENBLAS_NUM_THREADS": share},
                           env_unset=_BLAS_ENV, workloads=("chat",)),
        "llama": Config("llama", f"llama_cpp.server on the GGUF, {cores} threads, requests "
                        "queued (not interrupted)", "llama", 1, 1, env_unset=_BLAS_ENV),
    }
    variants_made = {name: shmcache(name, "a with " + shlex.join(
                         [f"{k}={v}" for k, v in env.items()] + list(argv)), *argv, env=env)
                     for name, (env, argv) in (variants or {}).items()}
    # a variant named like a built-in configuration (a-lend) is the variant
    return built_in | variants_made


def server_argv(cfg: Config, model: str, port: int, args) -> list[str]:
    if cfg.kind == "shmcache":
        return [sys.executable, "-m", "shmcache.cli", "serve", "--model", model,
                "--workers", str(args.workers), "--port", str(port), "--log-level", "warning",
                *cfg.serve_args, *shlex.split(args.serve_args)]
    if cfg.kind == "llama":
        return [sys.executable, "-m", "tools.bench.llama_server", "--model", args.gguf,
                "--port", str(port), "--n_threads", str(os.cpu_count() or 1),
                "--n_ctx", "4096",
                # its default (True) cuts a streaming reply off when the next
                # request arrives; queued instead, as concurrent clients need
                "--interrupt_requests", "False"]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port),
            "--prompt-cache-size", str(args.prompt_cache_size), "--log-level", "WARNING"]


# ------------------------------------------------------------------ one run
def _warm_up(client: httpx.Client, servers: list[Server], cfg: Config, workload: str,
             args) -> None:
    """Every process that generates runs one short request (concurrently)."""
    prompts = warmup_prompts(cfg.warmups * len(servers), args.seed)
    errs: list[str] = []

    def warm(j: int) -> None:
        url = servers[j % len(servers)].url
        try:
            if workload == "chat":
                chat_request(client, url, [{"role": "user", "content": prompts[j]}],
                             args.max_tokens, args.request_timeout)
            else:
                one_request(client, url, prompts[j], args.max_tokens, args.request_timeout)
        except Exception as e:  # noqa: BLE001
            errs.append(f"{type(e).__name__}: {e}")
    ts = [threading.Thread(target=warm, args=(j,), daemon=True) for j in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise RuntimeError(f"warm-up failed: {errs[0]}")


def _leak_check(servers: list[Server], shm_before: set[str]) -> list[str]:
    """Files its processes mapped, or anything new in /dev/shm naming one of its
    pids: removed, and returned."""
    pids = {p for s in servers for p in s.pids}
    mapped = {p for s in servers for p in s.shm_paths}
    left = []
    for name in sorted(_shm_entries() - shm_before):
        path = os.path.join(SHM_DIR, name)
        if path in mapped or any(re.search(rf"(?<!\d){pid}(?!\d)", name) for pid in pids):
            left.append(path)
    left += sorted(p for p in mapped if os.path.exists(p) and p not in left
                   and os.path.basename(p) not in shm_before)
    for path in left:
        try:
            os.unlink(path)
        except OSError:
            pass
    return left


def run_config(cfg: Config, args, workload: str, payload, logdir: str, rnd: int) -> dict:
    """Start, warm up, run, measure, stop. Returns the run's record."""
    rec: dict = {"config": cfg.name, "workload": workload, "round": rnd}
    servers: list[Server] = []
    shm_before = _shm_entries()
    conns = max(args.concurrency, args.sessions) + 8
    client = httpx.Client(trust_env=False,
                          limits=httpx.Limits(max_connections=conns,
                                              max_keepalive_connections=conns))
    try:
        model = args.gguf if cfg.kind == "llama" else args.model_dir
        for k in range(cfg.servers):
            port = free_port()
            s = Server(f"{workload}-{cfg.name}-{k}", server_argv(cfg, model, port, args),
                       cfg.env, port, logdir, env_unset=cfg.env_unset)
            if cfg.kind == "llama":
                s.health_path = "/v1/models"
            servers.append(s)
        rec["commands"] = [s.command() for s in servers]
        t0 = time.perf_counter()
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(client, args.startup_timeout,
                         workers=args.workers if cfg.kind == "shmcache" else 1)
        rec["startup_s"] = time.perf_counter() - t0
        _warm_up(client, servers, cfg, workload, args)
        for s in servers:
            s.observe()
        rec["blas"] = sorted({b for s in servers for b in s.blas()})
        log(f"  ready in {rec['startup_s']:.1f} s, warmed up; BLAS mapped: "
            f"{', '.join(rec['blas']) or 'none found'}; running")
        urls = [s.url for s in servers]
        roots = [s.proc.pid for s in servers]
        sampler = PssSampler(roots, args.pss_interval).start()
        cpu0 = tree_cpu_seconds(roots)
        try:
            if workload == "chat":
                records, wall = run_chat(client, urls, payload, args.max_tokens,
                                         args.request_timeout, route=cfg.route,
                                         sticky=args.sticky,
                                         concurrency=args.chat_concurrency)
            else:
                records, wall = run_workload(client, urls, payload, args.concurrency,
                                             args.max_tokens, args.request_timeout,
                                             first_alone=(workload == "shared"))
        finally:
            cpu1 = tree_cpu_seconds(roots)
            rec["pss_bytes"] = sampler.stop()
            rec["pss_samples"] = sampler.samples
        for s in servers:
            s.observe()
        rec.update(figures(records, wall))
        rec["cores_busy"] = (cpu1 - cpu0) / wall if wall > 0 else None
        for r in records:                # keep the JSON small: a checksum of each reply
            r["text_crc"] = zlib.crc32(r.pop("text", "").encode())
            r.pop("gaps_s", None)
        rec["request_records"] = records
        first_err = next((r["error"] for r in records if "error" in r), None)
        if first_err:
            rec["error"] = f"{rec['errors']} request(s) failed, e.g. {first_err}"
    except Exception as e:  # noqa: BLE001 - the run fails alone
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        client.close()
        rec["exit_codes"] = [s.stop() for s in servers]
        rec["server_pids"] = sorted({p for s in servers for p in s.pids})
        rec["shm_left"] = _leak_check(servers, shm_before)
    if rec["shm_left"]:
        rec.setdefault("error", f"left in /dev/shm: {', '.join(rec['shm_left'])} (removed)")
    return rec


def _replies_match(per: dict[str, list[dict]]) -> list[str]:
    """Notes where a configuration's replies differ from (a)'s (greedy decoding
    should give the same text; different replies make later chat turns differ)."""
    def key(r):
        return (r.get("session"), r.get("turn"), r.get("idx"))
    base = next((r for r in per.get("a", []) if "request_records" in r), None)
    if base is None:
        return []
    ref = {key(r): r.get("text_crc") for r in base["request_records"] if "error" not in r}
    out = []
    for name, rounds in per.items():
        for r in rounds:
            recs = [x for x in r.get("request_records", []) if "error" not in x
                    and key(x) in ref]
            same = sum(1 for x in recs if x.get("text_crc") == ref[key(x)])
            if recs and same < len(recs):
                out.append(f"{base['workload']} {name} round {r['round']}: {same}/{len(recs)} "
                           "replies equal to a's round-1 replies")
    return out


# ------------------------------------------------------------------ main
def _csv(raw: str) -> list[str]:
    return [c.strip() for c in raw.split(",") if c.strip()]


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo",
                    help="demo, realistic[:LAYERS] (default 24 layers) or a model directory "
                    "(default demo)")
    ap.add_argument("--workers", type=int, default=2,
                    help="shmcache workers (a) and mlx_lm.server processes (c) (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over everything (default 2)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, of {','.join(WORKLOADS)} (default all)")
    ap.add_argument("--configs", "--only", dest="configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, of {','.join(CONFIGS)} "
                    f"(default {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--max-tokens", type=int, default=24, help="max_tokens per request")
    g = ap.add_argument_group("shared and unique workloads")
    g.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    g.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    g.add_argument("--system-chars", type=int, default=600,
                   help="length of the shared prefix / the unique head (characters; default 600)")
    g.add_argument("--unique-every", type=int, default=4,
                   help="shared: every k-th request is a unique prompt (default 4)")
    g = ap.add_argument_group("chat workload")
    g.add_argument("--sessions", type=int, default=None,
                   help="chat sessions (default 2 x --workers)")
    g.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    g.add_argument("--chat-concurrency", type=int, default=None, metavar="K",
                   help="client threads; each takes the session that has waited longest "
                        "(default: --sessions, every session in flight at once; fewer "
                        "models many users who each think between two messages)")
    g.add_argument("--chat-system-chars", type=int, default=300,
                   help="the system message, the same for every session (default 300)")
    g.add_argument("--user-chars", default="40-120",
                   help="a user message's length range in characters (default 40-120)")
    g.add_argument("--sticky", choices=("balanced", "hash"), default="balanced",
                   help="c-sticky's session placement (default balanced)")
    g = ap.add_argument_group("llama.cpp")
    g.add_argument("--llama-cpp", action="store_true",
                   help="add llama.cpp's server (config llama) where llama_cpp imports")
    g.add_argument("--gguf", metavar="FILE", help="the GGUF file llama.cpp serves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="one more configuration, a-NAME: (a) with ARGS, more shmcache "
                         "serve flags led by any VAR=VALUE words for its environment "
                         "(repeatable; e.g. pack8='--pack-rows 8'); add a-NAME to --only")
    ap.add_argument("--serve-args", default="", metavar="ARGS",
                    help="extra flags for shmcache serve (a), e.g. '--prefill-step 256' "
                         "(default: none, its defaults)")
    ap.add_argument("--prompt-cache-size", type=int, default=10,
                    help="mlx_lm.server --prompt-cache-size (default 10, its own default)")
    ap.add_argument("--pss-interval", type=float, default=2.0,
                    help="seconds between PSS samples (default 2)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--blas", metavar="LIB", default=None,
                    help=f"the OpenBLAS every configuration runs on (default {DEBIAN_OPENBLAS},"
                    " else the one shmcache.system.blas finds)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    args = ap.parse_args(argv)
    if (args.workers < 1 or args.requests < 2 or args.rounds < 1 or args.concurrency < 1
            or args.turns < 1 or args.max_tokens < 1 or (args.sessions is not None
                                                         and args.sessions < 1)):
        ap.error("need --workers, --rounds, --concurrency, --turns, --sessions, --max-tokens "
                 ">= 1 and --requests >= 2")
    args.workloads = _csv(args.workloads)
    if not args.workloads or any(w not in WORKLOADS for w in args.workloads):
        ap.error(f"--workloads {','.join(args.workloads)}: choose from {','.join(WORKLOADS)}")
    args.variants = {}
    for v in args.variant:
        name, eq, rest = v.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            ap.error(f"--variant {v!r}: want NAME=ARGS, NAME of letters, digits, _ . -")
        words = shlex.split(rest)
        lead = list(itertools.takewhile(
            lambda w: re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w) is not None, words))
        args.variants["a-" + name] = (dict(w.split("=", 1) for w in lead),
                                      tuple(words[len(lead):]))
    args.configs = _csv(args.configs)
    if args.llama_cpp and "llama" not in args.configs:
        args.configs.append("llama")
    known = CONFIGS + tuple(args.variants)
    if not args.configs or any(c not in known for c in args.configs):
        ap.error(f"--configs {','.join(args.configs)}: choose from {','.join(known)}")
    m = re.fullmatch(r"(\d+)-(\d+)", args.user_chars)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        ap.error(f"--user-chars {args.user_chars}: want MIN-MAX, 1 <= MIN <= MAX")
    args.user_range = (int(m[1]), int(m[2]))
    if args.sessions is None:
        args.sessions = 2 * args.workers
    if args.chat_concurrency is not None and args.chat_concurrency < 1:
        ap.error(f"--chat-concurrency {args.chat_concurrency}: want at least 1")
    if args.model.endswith(".gguf") and os.path.isfile(args.model) and not args.gguf:
        args.gguf = args.model
    return args


def _blas_path(args) -> Optional[str]:
    if args.blas:
        return args.blas if os.path.isfile(args.blas) else None
    if os.path.isfile(DEBIAN_OPENBLAS):
        return DEBIAN_OPENBLAS
    import shmcache.system.blas as blas             # stdlib only: does not load mlx here
    return next(iter(blas.candidates()), None)


def _llama_skip(args) -> Optional[str]:
    try:
        import llama_cpp  # noqa: F401
        import llama_cpp.server  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        return f"llama_cpp does not import ({type(e).__name__}: {e}); not built here"
    if not args.gguf:
        return "no GGUF file to serve (--gguf FILE, or a .gguf --model)"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    bench_cmd = shlex.join([sys.executable, "-m", "tools.bench.serve"] +
                           list(sys.argv[1:] if argv is None else argv))
    blas_path = _blas_path(args)
    if blas_path is None:
        print(f"bench_serve: no OpenBLAS found ({args.blas or DEBIAN_OPENBLAS}); on Debian: "
              "apt-get install libopenblas0-pthread", file=sys.stderr)
        return 2
    try:
        args.model_dir, model_label = resolve(args.model)
    except ModelError as e:
        print(f"bench_serve: {e}", file=sys.stderr)
        return 2
    notes: list[str] = []
    if "llama" in args.configs and (why := _llama_skip(args)):
        log(f"skipping llama: {why}")
        notes.append(f"llama skipped: {why}")
        args.configs.remove("llama")
    configs = make_configs(args.workers, blas_path, args.sticky, args.variants)

    payloads, describe = {}, {}
    for w in args.workloads:
        if w == "chat":
            payloads[w] = build_chat(args.sessions, args.turns, args.seed,
                                     args.chat_system_chars, args.user_range)
            k = min(args.chat_concurrency or args.sessions, args.sessions)
            describe[w] = (f"{args.sessions} sessions x {args.turns} turns ({k} at a time), "
                           f"system message "
                           f"{args.chat_system_chars} chars, user turns {args.user_chars} "
                           f"chars, max_tokens {args.max_tokens}")
        else:
            every = args.unique_every if w == "shared" else 1
            payloads[w] = build_workload(args.requests, args.seed, args.system_chars, every)
            n_sh = sum(q.shared for q in payloads[w])
            describe[w] = (f"{args.requests} requests ({n_sh} with a {args.system_chars}-char "
                           f"shared prefix, {args.requests - n_sh} unique), concurrency "
                           f"{args.concurrency}, max_tokens {args.max_tokens}")
    plan = [(w, c) for w in args.workloads for c in args.configs
            if w in configs[c].workloads]
    log(f"model {args.model_dir} ({model_label}); BLAS {blas_path}; {args.workers} workers/"
        f"servers; {args.rounds} round(s) of {len(plan)} runs: "
        + ", ".join(f"{w}/{c}" for w, c in plan))

    # a SIGTERM stops the servers like Ctrl-C does
    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old_term = signal.signal(signal.SIGTERM, on_term)
    load0 = os.getloadavg()
    results: dict[str, dict[str, list[dict]]] = {w: {} for w in args.workloads}
    logdir = tempfile.mkdtemp(prefix="bench_serve-")
    t_all = time.perf_counter()
    n_done = 0
    try:
        for rnd in range(1, args.rounds + 1):
            for w, name in plan:
                cfg = configs[name]
                n_done += 1
                log(f"[{n_done}/{len(plan) * args.rounds}] round {rnd}/{args.rounds}, {w}, "
                    f"{name} ({cfg.label}): starting ({time.perf_counter() - t_all:.0f} s "
                    "elapsed)")
                t0 = time.perf_counter()
                rec = run_config(cfg, args, w, payloads[w], logdir, rnd)
                results[w].setdefault(name, []).append(rec)
                if "error" in rec:
                    log(f"  FAILED: {rec['error']}")
                else:
                    log(f"  {rec['throughput']:.2f} tok/s, TTFT cold p50 "
                        f"{_ms(rec['ttft_cold_p50'])} ms, warm p50 {_ms(rec['ttft_warm_p50'])}"
                        f" ms, longest pause p50 {_ms(rec['max_gap_p50'])} ms, PSS "
                        f"{rec['pss_bytes'] / 2**20:.0f} MiB, {rec['cores_busy']:.2f} cores "
                        f"busy ({time.perf_counter() - t0:.0f} s in all)")
    except KeyboardInterrupt:
        log("interrupted: stopping the servers")
        stop_all()
        return 130
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, old_term)
        if not args.keep_logs:
            for f in os.listdir(logdir):
                os.unlink(os.path.join(logdir, f))
            os.rmdir(logdir)
        else:
            log(f"server logs in {logdir}")

    for w in args.workloads:
        notes += _replies_match(results[w])
    summ = summarize(results)
    text = report(results, configs, summ, describe, bench_cmd, notes)
    print(f"model: {model_label} ({args.model_dir}); {os.cpu_count()} cores; load average "
          f"{load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"{time.perf_counter() - t_all:.0f} s")
    print(text)
    failed = any("error" in r for per in results.values() for rounds in per.values()
                 for r in rounds)
    if args.json:
        out = {"command": bench_cmd, "args": {k: v for k, v in vars(args).items()},
               "model": {"spec": args.model, "dir": args.model_dir, "label": model_label},
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version(), "loadavg_start": load0,
                           "loadavg_end": os.getloadavg()},
               "blas": blas_path, "notes": notes,
               "configs": {n: configs[n].label for n in args.configs},
               "workloads": {w: {"describe": describe[w], "runs": results[w], **summ[w]}
                             for w in args.workloads},
               "elapsed_s": time.perf_counter() - t_all, "ok": not failed}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

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
import random
import re
import shlex
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import psutil

CONFIGS = ("a", "b", "b-sameblas", "c", "c-sameblas")
TARGETS = {"b-sameblas": {"throughput": (">=", 1.5), "ttft_cached_p50": ("<=", 0.2)}}
SHM_DIR = "/dev/shm"
# printable ASCII, without the characters of the demo tokenizer's special
# tokens ("<|end|>" and the like), so a random text never spells one
ALPHABET = string.ascii_letters + string.digits + " .,;:!?'-()"
_BLAS_LIB = re.compile(r"(openblas|blis|mkl_rt|flexiblas|libblas|libcblas)", re.I)


def log(msg: str) -> None:
    print(f"[bench_serve] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Req:
    idx: int
    prompt: str
    shared: bool


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def build_workload(n: int, seed: int = 0, system_chars: int = 1000,
                   unique_every: int = 4) -> list[Req]:
    """n requests; request 0 has the shared prefix, every unique_every-th (i % k == k-1)
    is a unique prompt of the same length distribution."""
    rng = random.Random(f"bench_serve-{seed}")
    system = "System: " + _text(rng, max(0, system_chars - 8))
    out = []
    for i in range(n):
        user = "\nUser: " + _text(rng, rng.randint(24, 159)) + "\nAssistant:"
        unique = unique_every > 0 and i % unique_every == unique_every - 1
        head = _text(rng, len(system)) if unique else system
        out.append(Req(i, head + user, not unique))
    return out


def warmup_prompts(k: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"bench_serve-warmup-{seed}")
    return [_text(rng, 200) for _ in range(k)]


# ------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def tree_pss(pids: list[int]) -> int:
    """Summed PSS in bytes of these processes and all their children."""
    total = 0
    for pid in pids:
        for p in _tree(pid):
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return total


def _maps(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line[line.index("/"):].rstrip("\n") for line in f if "/" in line]
    except OSError:
        return []


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


class Server:
    """One server process (started in its own session, so its group is its own)."""

    def __init__(self, label: str, argv: list[str], env_set: dict, port: int, logdir: str):
        self.label, self.argv, self.env_set, self.port = label, argv, env_set, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(logdir, f"{label}-{port}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.pids: set[int] = set()          # every process of its tree seen so far
        self.shm_paths: set[str] = set()     # /dev/shm files its tree mapped

    def command(self) -> str:
        unset = ["-u", "LD_PRELOAD"] if "LD_PRELOAD" in os.environ and \
            "LD_PRELOAD" not in self.env_set else []
        env = [f"{k}={v}" for k, v in self.env_set.items()]
        pre = (["env"] + unset + env) if unset else env
        return shlex.join(pre + self.argv)

    def start(self) -> None:
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        env.update(self.env_set)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.pids.add(self.proc.pid)

    def log_tail(self, n: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, client: httpx.Client, timeout: float, workers: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode} before it "
                                   f"was ready; its log:\n{self.log_tail()}")
            try:
                r = client.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    alive = r.json().get("workers_alive")
                    if alive is None or alive >= workers:
                        return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} not ready after {timeout:.0f} s; its log:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.25)

    def observe(self) -> None:
        """Remember its processes and the /dev/shm files they map (for the leak check)."""
        if self.proc is None:
            return
        for p in _tree(self.proc.pid):
            self.pids.add(p.pid)
            for path in _maps(p.pid):
                if path.startswith(SHM_DIR + "/"):
                    self.shm_paths.add(path.split(" (deleted)")[0])

    def blas(self) -> list[str]:
        """Basenames of the BLAS libraries mapped into its processes."""
        found = set()
        if self.proc is not None:
            for p in _tree(self.proc.pid):
                for path in _maps(p.pid):
                    base = os.path.basename(path)
                    # numpy's own OpenBLAS (scipy_openblas64_) is not one libmlx can bind
                    if _BLAS_LIB.search(base) and "scipy_openblas" not in base:
                        found.add(base)
        return sorted(found)

    def stop(self, grace: float = 20.0) -> Optional[int]:
        if self.proc is None:
            return None
        self.observe()
        procs = []
        for pid in self.pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log(f"{self.label}: no exit {grace:.0f} s after SIGTERM: SIGKILL")
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # its own group: what is left of it
        except (ProcessLookupError, PermissionError):
            pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:                  # a child that left the group: ours all the same
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        rc = self.proc.wait()
        self._log.close()
        return rc


# ------------------------------------------------------------------ client
def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int,
                timeout: float) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue                 # blank lines, ": keepalive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("error"):
                raise RuntimeError(f"error event: {ev['error']}")
            for ch in ev.get("choices") or ():
                if ch.get("text"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
            if ev.get("usage"):
                usage = ev["usage"]
    t1 = time.perf_counter()
    usage = usage or {}
    return {"ttft_s": ttft, "latency_s": t1 - t0, "t_end": t1,
            "completion_tokens": usage.get("completion_tokens", chunks),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def run_workload(client: httpx.Client, urls: list[str], reqs: list[Req], concurrency: int,
                 max_tokens: int, timeout: float) -> tuple[list[dict], float]:
    """Request 0 alone, then the rest from concurrency threads; request i goes to
    urls[i % len(urls)]. Returns (per-request records, wall seconds)."""
    results: list[Optional[dict]] = [None] * len(reqs)

    def do(i: int) -> None:
        q = reqs[i]
        rec = {"idx": i, "shared": q.shared, "server": i % len(urls)}
        try:
            rec.update(one_request(client, urls[i % len(urls)], q.prompt, max_tokens, timeout))
        except Exception as e:  # noqa: BLE001 - recorded, counted as a failure
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["t_end"] = time.perf_counter()
        results[i] = rec

    t0 = time.perf_counter()
    if reqs:
        do(0)
    todo = iter(range(1, len(reqs)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            do(i)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max((r["t_end"] for r in results if r), default=t0) - t0
    return results, wall


def pct(values: list[float], q: float) -> Optional[float]:
    """The q-quantile (0..1) with linear interpolation; None for no values."""
    v = sorted(values)
    if not v:
        return None
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def figures(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if "error" not in r]
    shared = [r for r in ok if r["shared"] and r["idx"] != 0]
    unique = [r for r in ok if not r["shared"]]
    tok = sum(r["completion_tokens"] or 0 for r in ok)

    def ttfts(rs):
        return [r["ttft_s"] for r in rs if r["ttft_s"] is not None]

    def mean_cached(rs):
        c = [r["cached_tokens"] for r in rs if r.get("cached_tokens") is not None]
        return sum(c) / len(c) if c else None

    return {"requests": len(records), "errors": len(records) - len(ok),
            "generated_tokens": tok, "wall_s": wall,
            "throughput": tok / wall if wall > 0 else None,
            "ttft_cached_p50": pct(ttfts(shared), 0.5), "ttft_cached_p90": pct(ttfts(shared), 0.9),
            "ttft_unique_p50": pct(ttfts(unique), 0.5), "ttft_unique_p90": pct(ttfts(unique), 0.9),
            "n_cached": len(shared), "n_unique": len(unique),
            "cached_tokens_shared": mean_cached(shared), "cached_tokens_unique": mean_cached(unique),
            "prompt_tokens_mean": (sum(r["prompt_tokens"] for r in ok if r.get("prompt_tokens"))
                                   / max(1, sum(1 for r in ok if r.get("prompt_tokens"))))}


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


# ------------------------------------------------------------------ report
def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"


def _span(vals: list, fmt) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    lo, hi = min(vals), max(vals)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


METRICS = [  # key, column head, format
    ("throughput", "tok/s", lambda v: f"{v:.1f}"),
    ("ttft_cached_p50", "TTFT cached p50 ms", _ms),
    ("ttft_cached_p90", "p90 ms", _ms),
    ("ttft_unique_p50", "TTFT unique p50 ms", _ms),
    ("ttft_unique_p90", "p90 ms", _ms),
    ("pss_bytes", "PSS MiB", lambda v: f"{v / 2**20:.0f}"),
    ("cached_tokens_shared", "cached tok/req", lambda v: f"{v:.0f}"),
]
RATIOS = [("throughput", "throughput"), ("ttft_cached_p50", "TTFT cached p50"),
          ("ttft_unique_p50", "TTFT unique p50"), ("pss_bytes", "PSS")]
_OPS = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t}


def _table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = [" | ".join(h.ljust(x) for h, x in zip(head, w)), "-+-".join("-" * x for x in w)]
    out += [" | ".join(c.ljust(x) for c, x in zip(r, w)) for r in rows]
    return "\n".join(out)


def summarize(results: dict[str, list[dict]]) -> dict:
    """min/max per metric over rounds; (a)/x ratios paired by round; targets."""
    summary, ratios = {}, {}
    for name, rounds in results.items():
        good = [r for r in rounds if "error" not in r]
        summary[name] = {k: [min(v), max(v)] if (v := [r[k] for r in good
                                                      if r.get(k) is not None]) else None
                         for k, _, _ in METRICS}
    a = {r["round"]: r for r in results.get("a", []) if "error" not in r}
    for name, rounds in results.items():
        if name == "a":
            continue
        per = {}
        for key, _ in RATIOS:
            vals = [a[r["round"]][key] / r[key] for r in rounds
                    if "error" not in r and r["round"] in a and a[r["round"]].get(key)
                    is not None and r.get(key)]
            entry = {"min": min(vals), "max": max(vals), "rounds": vals} if vals else None
            t = TARGETS.get(name, {}).get(key)
            if t and entry:
                ok = [_OPS[t[0]](v, t[1]) for v in vals]
                entry["target"] = f"{t[0]} {t[1]:g}"
                entry["met"] = "yes" if all(ok) else ("NO" if not any(ok) else "in some rounds")
            per[key] = entry
        ratios[name] = per
    return {"summary": summary, "ratios": ratios}


def report(results, configs, summ, args, bench_cmd) -> str:
    lines = []
    rows = []
    for name, rounds in results.items():
        s = summ["summary"][name]
        bad = sum(1 for r in rounds if "error" in r)
        rows.append([name] + [_span(s[k] or [], f) for k, _, f in METRICS] +
                    [f"{len(rounds) - bad}/{len(rounds)}"])
    lines.append(_table(["config"] + [h for _, h, _ in METRICS] + ["ok rounds"], rows))
    if summ["ratios"]:
        lines.append("")
        lines.append("(a) / other, paired by round (min-max over rounds); "
                     "targets against b-sameblas:")
        rrows = []
        for name, per in summ["ratios"].items():
            cells = []
            for key, _ in RATIOS:
                e = per.get(key)
                cells.append("n/a" if not e else _span(e["rounds"], lambda v: f"{v:.2f}x"))
            tg = [f"{dict(RATIOS)[k]} {e['target']}: {e['met']}"
                  for k, e in per.items() if e and "target" in e]
            rrows.append([f"a / {name}"] + cells + ["; ".join(tg)])
        lines.append(_table(["ratio"] + [h for _, h in RATIOS] + ["target met?"], rrows))
    lines.append("")
    lines.append("configurations:")
    for name in results:
        lines.append(f"  {name:<10} {configs[name].label}")
    lines.append("")
    lines.append("commands (ports are free ports picked per round; all rounds in the JSON):")
    lines.append(f"  bench:      {bench_cmd}")
    for name, rounds in results.items():
        cmds = next((r["commands"] for r in rounds if r.get("commands")), [])
        for k, c in enumerate(cmds):
            lines.append(f"  {name if k == 0 else '':<10}  {c}")
    notes = []
    for name, rounds in results.items():
        for r in rounds:
            if "error" in r:
                notes.append(f"  {name} round {r['round']}: {r['error'].splitlines()[0]}")
    if notes:
        lines.append("")
        lines.append("failures:")
        lines += notes
    return "\n".join(lines)


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

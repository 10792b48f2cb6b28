"""The Redis tier (L2) of ``shmcache serve``, measured.

Three figures (``python -m tools.bench_l2``; a real ``redis-server`` is
started on a free port by ``tools/redis_server.py``: no persistence,
``allkeys-lru``, 4 GB):

* **TTFT of a 2,048-token prompt** (token ids, ``max_tokens`` 8, streamed,
  client-side time to the first token), on two servers ("host A" and "host
  B", each its own pool, both ``--l2`` on the Redis, one ``--cluster-secret``):
  computed (a new prompt on A), **from L2** (the same prompt on B, whose pool
  has never seen it: its 127 full blocks come from Redis) and **an L1 hit**
  (the same prompt on B again). Median over ``--rounds`` prompts; the target
  is L2 <= 0.3x computing.
* **L2 load bandwidth**, in this process: N blocks written to Redis by one
  pool's ``L2Tier`` and loaded by another's (``MGET``, header and MAC
  checks, writes into pool blocks, publication), GB/s of payload; for the
  served model's layout and for a larger one (32 layers, 8 KV heads, head dim
  128, bfloat16: 2 MiB per 16-token block, as an 8B model's). "MGET only"
  is the network part alone.
* **Throughput with ``--l2`` and no L2 hits** against no ``--l2``: unique
  prompts (nothing shared, so every block is computed and, with ``--l2``,
  looked up and written back), ``--concurrency`` client threads; generated
  tokens per second, the two servers alternating over ``--tp-rounds``. The
  target is >= 0.95.

A benchmark, not a test: unmet targets do not change the exit status; a
failure (no redis-server, a server that does not start, a wrong cached
count) does (exit 1).

    python -m tools.bench_l2
    python -m tools.bench_l2 --rounds 5 --tp-rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time

import httpx

from tools.bench_serve import Server, _ms, _table, free_port
from tools.redis_server import RedisServer, find_redis_server

PROMPT_TOKENS = 2048
SECRET = "bench-l2-secret"
PRINTABLE = list(range(0x20, 0x7F))        # the demo tokenizer: id == byte


def log(msg: str) -> None:
    print(f"[bench_l2] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ client
def request(client: httpx.Client, url: str, prompt: list, max_tokens: int,
            timeout: float = 600) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("error"):
                raise RuntimeError(f"error event: {ev['error']}")
            if ttft is None and any(c.get("text") for c in ev.get("choices") or ()):
                ttft = time.perf_counter() - t0
            if ev.get("usage"):
                usage = ev["usage"]
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0,
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def metric(client: httpx.Client, url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = client.get(url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and not s.labels:
                return s.value
    return 0.0


def wait_metric(client, url, name, at_least, timeout=120) -> float:
    deadline = time.monotonic() + timeout
    while True:
        v = metric(client, url, name)
        if v >= at_least:
            return v
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} stayed at {v} < {at_least} for {timeout} s")
        time.sleep(0.1)


def serve_argv(model: str, port: int, workers: int, *extra) -> list:
    return [sys.executable, "-m", "shmcache.cli", "serve", "--model", model, "--workers",
            str(workers), "--port", str(port), "--log-level", "warning", *map(str, extra)]


def start(label, argv, port, logdir, client, workers, env=None) -> Server:
    s = Server(label, argv, env or {}, port, logdir)
    s.start()
    s.wait_ready(client, 300, workers=workers)
    return s


# ------------------------------------------------------------------ parts
def ttft_part(args, redis_url, client, logdir) -> dict:
    bs = args.block_size
    full = (PROMPT_TOKENS - 1) // bs * bs
    extra = ("--l2", redis_url, "--l2-timeout", args.l2_timeout, "--block-size", bs)
    env = {"SHMCACHE_CLUSTER_SECRET": SECRET}       # (not on the command line)
    servers = []
    out: dict = {"compute": [], "l2": [], "l1": [], "commands": []}
    try:
        for label in ("host-a", "host-b"):
            port = free_port()
            servers.append(start(label, serve_argv(args.model, port, args.workers, *extra), port,
                                 logdir, client, args.workers, env))
        a, b = servers
        out["commands"] = [s.command() for s in servers]
        rng = random.Random(f"bench_l2-{args.seed}")
        for w in range(2):                           # warm-up: one short request each
            for s in servers:
                request(client, s.url, [rng.choice(PRINTABLE) for _ in range(40)], 4)
        for rnd in range(args.rounds):
            prompt = [rng.choice(PRINTABLE) for _ in range(PROMPT_TOKENS)]
            writes = metric(client, a.url, "shmcache_l2_writes_total")
            c = request(client, a.url, prompt, args.max_tokens)
            if c["cached_tokens"]:
                raise RuntimeError(f"a new prompt had {c['cached_tokens']} cached tokens on A")
            wait_metric(client, a.url, "shmcache_l2_writes_total", writes + full // bs)
            l2 = request(client, b.url, prompt, args.max_tokens)
            l1 = request(client, b.url, prompt, args.max_tokens)
            for name, r in (("l2", l2), ("l1", l1)):
                if r["cached_tokens"] != full:
                    raise RuntimeError(f"{name} request on B: {r['cached_tokens']} cached tokens, "
                                       f"expected {full}")
            out["compute"].append(c["ttft_s"])
            out["l2"].append(l2["ttft_s"])
            out["l1"].append(l1["ttft_s"])
            log(f"TTFT round {rnd + 1}/{args.rounds}: compute {c['ttft_s'] * 1e3:.0f} ms, L2 "
                f"{l2['ttft_s'] * 1e3:.0f} ms, L1 {l1['ttft_s'] * 1e3:.0f} ms")
        out["l2_read_bytes"] = metric(client, b.url, "shmcache_l2_read_bytes_total")
        out["l2_hits"] = metric(client, b.url, "shmcache_l2_hits_total")
    finally:
        for s in servers:
            s.stop()
    return out


def bandwidth_part(args, redis_url, model_layout: dict) -> list:
    """In this process: write N blocks from pool A, load them into pool B."""
    import mlx.core as mx  # noqa: F401
    import numpy as np

    import shmcache
    from shmcache import l2 as L2

    rows = []
    layouts = [("served model", model_layout, args.bw_blocks),
               ("8B-like (32 L, 8 KVH, hd 128, bf16)",
                dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
                args.bw_big_blocks)]
    for label, lay, n in layouts:
        pools = []
        tiers = []
        try:
            for k in range(2):
                pools.append(shmcache.create_pool(f"bench-l2-{os.getpid()}-{k}",
                                                  block_size=args.block_size,
                                                  max_blocks=n + 2, **lay))
            secret = os.urandom(16)
            for m in pools:
                tiers.append(L2.L2Tier(m, redis_url, model_id=f"bench@{label}", secret=secret,
                                       timeout=5, write_timeout=60, queue_bytes=1 << 40))
            a, b = pools
            bs = args.block_size
            toks = list(range(n * bs))
            t = a.create_block_table("w")
            a.prepare_append(t, n * bs)
            kv = a.export_blocks(t.block_ids)               # (L, n, 2, H, T, D), a copy
            kv.reshape(-1).view(np.uint8)[:] = np.frombuffer(
                np.random.default_rng(0).bytes(kv.nbytes), np.uint8)
            a.import_blocks(t.block_ids, kv)
            a.cache_full_blocks(t.block_ids, toks, 0, n)
            chain = tiers[0].chain(toks, n)
            t0 = time.perf_counter()
            tiers[0].write_back(t.block_ids, chain)
            tiers[0].store.flush(600)
            wt = time.perf_counter() - t0
            payload = n * tiers[0].codec.layout.block_bytes
            best_load, best_mget = None, None
            for rep in range(args.bw_reps):
                tb = b.create_block_table(f"r{rep}")
                t0 = time.perf_counter()
                got = tiers[1].load(tb, toks, None, 0, chain)
                dt = time.perf_counter() - t0
                if got != n:
                    raise RuntimeError(f"loaded {got} of {n} blocks")
                best_load = dt if best_load is None else min(best_load, dt)
                if rep == 0 and (L2.read_blocks(a, t.block_ids).tobytes()       # bit-exact
                                 != L2.read_blocks(b, tb.block_ids).tobytes()):
                    raise RuntimeError("the blocks loaded from L2 differ from the written ones")
                b.delete_block_table(f"r{rep}")
                b.reset_prefix_cache()
                keys = [k for h in chain for k in tiers[1].codec.keys(h)]
                t0 = time.perf_counter()
                for i in range(0, len(keys), 64):
                    tiers[1].store._r.mget(keys[i:i + 64])
                dt = time.perf_counter() - t0
                best_mget = dt if best_mget is None else min(best_mget, dt)
            rows.append(dict(layout=label, blocks=n, block_bytes=tiers[0].codec.layout.block_bytes,
                             chunks=len(tiers[0].codec.chunks), write_s=wt, load_s=best_load,
                             mget_s=best_mget, load_gbs=payload / best_load / 1e9,
                             mget_gbs=payload / best_mget / 1e9, write_gbs=payload / wt / 1e9))
            log(f"bandwidth {label}: load {payload / best_load / 1e9:.2f} GB/s, MGET only "
                f"{payload / best_mget / 1e9:.2f} GB/s, write-back {payload / wt / 1e9:.2f} GB/s")
        finally:
            for tr in tiers:
                tr.close(flush_s=0)
            for m in pools:
                m.destroy()
    return rows


def throughput_part(args, redis_url, client, logdir) -> dict:
    out: dict = {"l2": [], "none": [], "commands": {}}
    rng = random.Random(f"bench_l2-tp-{args.seed}")
    servers = {}
    try:
        for name, extra in (("l2", ("--l2", redis_url, "--l2-timeout", args.l2_timeout)),
                            ("none", ())):
            port = free_port()
            servers[name] = start(f"tp-{name}", serve_argv(args.model, port, args.workers,
                                                           "--block-size", args.block_size,
                                                           *extra), port, logdir, client,
                                  args.workers)
            out["commands"][name] = servers[name].command()
        for s in servers.values():                       # warm-up
            request(client, s.url, [rng.choice(PRINTABLE) for _ in range(40)], 4)
        for rnd in range(args.tp_rounds):
            for name in (("l2", "none") if rnd % 2 == 0 else ("none", "l2")):
                url = servers[name].url
                prompts = [[rng.choice(PRINTABLE) for _ in range(args.tp_prompt_tokens)]
                           for _ in range(args.tp_requests)]
                todo = iter(prompts)
                lock = threading.Lock()
                toks, errs = [], []

                def work():
                    while True:
                        with lock:
                            p = next(todo, None)
                        if p is None:
                            return
                        try:
                            r = request(client, url, p, args.tp_max_tokens)
                            toks.append(r["completion_tokens"])
                        except Exception as e:  # noqa: BLE001
                            errs.append(e)
                t0 = time.perf_counter()
                ts = [threading.Thread(target=work) for _ in range(args.concurrency)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                wall = time.perf_counter() - t0
                if errs:
                    raise RuntimeError(f"{name}: {errs[0]}")
                out[name].append(sum(toks) / wall)
                log(f"throughput round {rnd + 1}/{args.tp_rounds} {name}: "
                    f"{sum(toks) / wall:.1f} tok/s")
        url = servers["l2"].url
        out["l2_hits"] = metric(client, url, "shmcache_l2_hits_total")
        out["l2_writes"] = wait_metric(client, url, "shmcache_l2_writes_total", 1)
        for k in ("dropped", "timeouts", "outages", "lookups", "misses"):
            out[f"l2_{k}"] = metric(client, url, f"shmcache_l2_{k}_total")
    finally:
        for s in servers.values():
            s.stop()
    return out


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_l2", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", metavar="DIR", help="model directory (default: the demo model)")
    ap.add_argument("--workers", type=int, default=1, help="workers per server (default 1)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="TTFT prompts (default 3)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--l2-timeout", type=float, default=0.05)
    ap.add_argument("--bw-blocks", type=int, default=512,
                    help="blocks loaded, the served layout (default 512)")
    ap.add_argument("--bw-big-blocks", type=int, default=32,
                    help="blocks loaded, the 8B-like layout (default 32: 128 MiB)")
    ap.add_argument("--bw-reps", type=int, default=3)
    ap.add_argument("--tp-rounds", type=int, default=6,
                    help="throughput runs per server, alternating (default 6)")
    ap.add_argument("--tp-requests", type=int, default=24)
    ap.add_argument("--tp-prompt-tokens", type=int, default=256)
    ap.add_argument("--tp-max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: ttft,bw,tp")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    cmd = shlex.join([sys.executable, "-m", "tools.bench_l2"] +
                     list(sys.argv[1:] if argv is None else argv))
    binary = find_redis_server()
    if binary is None:
        log("redis-server not found (apt-get install redis-server): nothing measured")
        return 1
    from shmcache.demo_model import ensure_demo_model
    if args.model is None:
        args.model = str(ensure_demo_model())
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    from mlx_lm.utils import load_model

    import shmcache  # noqa: F401  (the BLAS first)
    from shmcache.mlx_lm import pool_layout
    model, _ = load_model(__import__("pathlib").Path(args.model), lazy=True)
    lay = pool_layout(model)
    del model
    log(f"model {args.model} ({cfg.get('model_type')}: {lay}); redis-server {binary}")
    rd = RedisServer(binary, maxmemory="4gb")
    rd_client = rd.client()
    client = httpx.Client(trust_env=False, limits=httpx.Limits(max_connections=32))
    logdir = tempfile.mkdtemp(prefix="bench_l2-")
    res: dict = {"command": cmd, "redis": rd.argv}
    load0 = os.getloadavg()
    try:
        if "ttft" not in skip:
            res["ttft"] = ttft_part(args, rd.url, client, logdir)
            rd_client.flushdb()
        if "bw" not in skip:
            res["bandwidth"] = bandwidth_part(args, rd.url, lay)
            rd_client.flushdb()
        if "tp" not in skip:
            res["throughput"] = throughput_part(args, rd.url, client, logdir)
    finally:
        client.close()
        rd_client.close()
        rd.stop()
        shutil.rmtree(logdir, ignore_errors=True)
    res["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                      "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    print(report(res, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def report(res: dict, args) -> str:
    lines = []
    if "ttft" in res:
        t = res["ttft"]
        med = {k: statistics.median(t[k]) for k in ("compute", "l2", "l1")}
        rows = [[name, _ms(med[k]), f"{_ms(min(t[k]))}-{_ms(max(t[k]))}",
                 f"{med[k] / med['compute']:.2f}x", target]
                for name, k, target in (("computed (cold everywhere)", "compute", ""),
                                        ("prefix from L2 (cold L1, host B)", "l2",
                                         "<= 0.30x: " + ("met" if med["l2"] <= 0.3 * med["compute"]
                                                         else "NOT met")),
                                        ("L1 hit (host B again)", "l1", ""))]
        lines.append(f"TTFT, {PROMPT_TOKENS}-token prompt, {len(t['compute'])} prompts "
                     f"(median, min-max):")
        lines.append(_table(["path", "TTFT ms", "min-max ms", "vs computed", "target"], rows))
        lines.append("")
    if "bandwidth" in res:
        rows = [[r["layout"], f"{r['blocks']} x {r['block_bytes'] / 2**10:.0f} KiB"
                 + (f" ({r['chunks']} chunks)" if r["chunks"] > 1 else ""),
                 f"{r['load_gbs']:.2f}", f"{r['mget_gbs']:.2f}", f"{r['write_gbs']:.2f}"]
                for r in res["bandwidth"]]
        lines.append("L2 bandwidth (one process, loopback Redis; best of "
                     f"{args.bw_reps}; GB/s of K/V payload):")
        lines.append(_table(["layout", "blocks", "load into pool", "MGET only",
                             "write-back"], rows))
        lines.append("")
    if "throughput" in res:
        t = res["throughput"]
        ratios = [x / y for x, y in zip(t["l2"], t["none"])]
        r = statistics.median(t["l2"]) / statistics.median(t["none"])
        rows = [["--l2 (no hits)", f"{statistics.median(t['l2']):.1f}",
                 f"{min(t['l2']):.1f}-{max(t['l2']):.1f}"],
                ["no --l2", f"{statistics.median(t['none']):.1f}",
                 f"{min(t['none']):.1f}-{max(t['none']):.1f}"]]
        lines.append(f"throughput, {args.tp_requests} unique {args.tp_prompt_tokens}-token "
                     f"prompts x {args.tp_max_tokens} tokens, concurrency {args.concurrency}, "
                     f"{args.tp_rounds} runs each, alternating:")
        lines.append(_table(["server", "tok/s median", "min-max"], rows))
        lines.append(f"ratio --l2 / none: {r:.3f} (runs paired: "
                     f"{', '.join(f'{x:.2f}' for x in ratios)}); target >= 0.95: "
                     f"{'met' if r >= 0.95 else 'NOT met'}; L2 hits "
                     f"{t['l2_hits']:.0f} (lookups {t['l2_lookups']:.0f}, blocks missed "
                     f"{t['l2_misses']:.0f}), blocks written {t['l2_writes']:.0f}, dropped "
                     f"{t['l2_dropped']:.0f}, timeouts {t['l2_timeouts']:.0f}, outages "
                     f"{t['l2_outages']:.0f}")
        lines.append("")
    lines.append(f"bench:  {res['command']}")
    lines.append(f"redis:  {shlex.join(res['redis'])}")
    for c in res.get("ttft", {}).get("commands", []):
        lines.append(f"server: {c}")
    for name, c in res.get("throughput", {}).get("commands", {}).items():
        lines.append(f"server: {c}")
    m = res["machine"]
    lines.append(f"machine: {m['cpus']} CPUs, {m['platform']}, load average "
                 f"{m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

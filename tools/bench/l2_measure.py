"""The three measurements of ``python -m tools.bench.l2`` (see its docstring).

``ttft_part`` (time to the first token: computed, from L2, an L1 hit, on two
servers sharing one Redis), ``bandwidth_part`` (blocks written to Redis by
one pool's ``L2Tier`` and loaded by another's, in this process) and
``throughput_part`` (``--l2`` with no hits against no ``--l2``); each
returns its raw figures, which ``tools.bench.l2`` turns into tables. With
them, what they share: one streamed completion request timed
(``request``), a server's Prometheus counters (``metric``,
``wait_metric``) and a ``shmcache serve`` started and waited for.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import httpx

from tools.bench.serve import Server, free_port
from tools.bench.serve_client import one_request

PROMPT_TOKENS = 2048
SECRET = "bench-l2-secret"
PRINTABLE = list(range(0x20, 0x7F))        # the demo tokenizer: id == byte


def log(msg: str) -> None:
    print(f"[bench_l2] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ client
def request(client: httpx.Client, url: str, prompt: list, max_tokens: int,
            timeout: float = 600) -> dict:
    """One streamed completion (bench_serve_client's), cached_tokens 0 when unreported."""
    r = one_request(client, url, prompt, max_tokens, timeout)
    r["cached_tokens"] = r["cached_tokens"] or 0
    return r


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

"""The Redis tier (L2) of ``shmcache serve``, measured.

Three figures (``python -m tools.bench.l2``; a real ``redis-server`` is
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

    python -m tools.bench.l2
    python -m tools.bench.l2 --rounds 5 --tp-rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile

import httpx

# (the measurements are in tools.bench.l2_measure; here: the command line,
# the run of the parts and the tables; the docstring above is --help's)
from tools.bench.l2_measure import PROMPT_TOKENS, bandwidth_part, log, throughput_part, ttft_part
from tools.bench.serve import _ms, _table
from tools.redis_server import RedisServer, find_redis_server


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.l2", description=__doc__,
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
    cmd = shlex.join([sys.executable, "-m", "tools.bench.l2"] +
                     list(sys.argv[1:] if argv is None else argv))
    binary = find_redis_server()
    if binary is None:
        log("redis-server not found (apt-get install redis-server): nothing measured")
        return 1
    from shmcache.models.demo_model import ensure_demo_model
    if args.model is None:
        args.model = str(ensure_demo_model())
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    from mlx_lm.utils import load_model

    import shmcache  # noqa: F401  (the BLAS first)
    from shmcache.models.mlx_lm import pool_layout
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

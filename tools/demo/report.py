"""The demo driver's report: figures of a run (``percentiles``) and its text (``print_report``)."""

from __future__ import annotations

import numpy as np

from .serve_process import STOP_TIMEOUT_S


def percentiles(xs) -> dict:
    """p50, p90, max and n of ``xs`` (None for an empty list)."""
    if not xs:
        return {"p50": None, "p90": None, "max": None, "n": 0}
    a = np.asarray(xs)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "max": float(a.max()), "n": int(a.size)}


def print_report(r: dict) -> None:
    """The report as text on stdout (``r``: ``Run.report``'s, with ``server_stop``)."""
    mb = 1 << 20
    print(f"requests: {len(r['requests'])} done, {len(r['failed'])} failed, "
          f"{r['generated_tokens']} tokens in {r['wall_s']:.1f}s "
          f"({r['throughput_tokens_per_s']:.1f} tok/s, {r['throughput_requests_per_s']:.2f} req/s) "
          f"on {r['workers']} workers, model {r['model']}")
    print(f"prefix cache: {'on' if r['prefix_cache'] else 'off'}, hit rate {r['prefix_hit_rate']:.1%} "
          f"(cached prompt tokens / prompt tokens); cow copies {r['cow_copies']}, "
          f"evictions {r['evictions']}, preemptions {r['preemptions']}")
    print(f"kv memory at peak: {r['kv_bytes_in_pool'] / mb:.1f} MiB in the shared pool vs "
          f"{r['kv_bytes_without_sharing'] / mb:.1f} MiB in private caches (no sharing)")
    for k in ("ttft_cached_s", "ttft_uncached_s"):
        t = r[k]
        name = k[:-2].replace("_", " ")
        if t["n"]:
            print(f"{name}: p50 {t['p50'] * 1e3:.0f} ms, p90 {t['p90'] * 1e3:.0f} ms (n={t['n']}; "
                  "from sending to the first token chunk)")
        else:
            print(f"{name}: no such request")
    print(f"worker restarts {r['worker_restarts']} (kills {r['worker_kills']}); leaked blocks "
          f"{r['leaked_blocks']}; check violations {r['check_violations']}")
    if r.get("l2") is not None:
        print_l2(r["l2_url"], r["l2"])
    left = r.get("server_stop")
    if left is not None:
        print(f"server stopped (exit {left['server_exit_code']}"
              f"{', killed after ' + str(int(STOP_TIMEOUT_S)) + ' s' if left['server_killed'] else ''}); "
              f"pool {'LEFT in /dev/shm (removed now)' if left['pool_left'] else 'removed'}"
              + (f"; worker processes left: {left['processes_left']}" if left['processes_left'] else ""))
    if r["outputs_inexact"]:
        print(f"note: the text of requests {r['outputs_inexact']} does not map back to the exact "
              "token ids generated (not valid UTF-8, or an end-of-sequence token)")
    for rid, err in r["failed"].items():
        print(f"request {rid} failed: {err}")
    for a in r.get("answers", ()):
        print(f"Q: {a['question']}\nA: {a['answer'].strip()!s}"
              + ("" if a["finish_reason"] == "stop" else f"  [{a['finish_reason']}]"))



def print_l2(url: str, c: dict) -> None:
    """The L2 lines: the pool's counters, summed over every worker."""
    mb = 1 << 20
    looked = c["hits"] + c["misses"]
    print(f"L2 {url}: lookups {c['lookups']}, blocks hit {c['hits']} of {looked} looked up, "
          f"read {c['read_bytes'] / mb:.1f} MiB; blocks written {c['writes']} "
          f"({c['written_bytes'] / mb:.1f} MiB), dropped {c['dropped']}")
    print(f"L2 faults: rejected values {c['rejected']}, timeouts {c['timeouts']}, errors "
          f"{c['errors']}, outages {c['outages']}")

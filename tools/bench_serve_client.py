"""The workload of ``tools.bench_serve``, the client that sends it, and its figures.

The workload (seeded, the same text for every configuration): a shared
system prompt followed by a short user turn; every ``unique_every``-th
request instead has a prompt of the same length that shares no prefix.
Each request is a streamed text completion, timed from sending it to its
first streamed text (TTFT).
"""

from __future__ import annotations

import json
import random
import string
import threading
import time
from dataclasses import dataclass
from typing import Optional

import httpx

# printable ASCII, without the characters of the demo tokenizer's special
# tokens ("<|end|>" and the like), so a random text never spells one
ALPHABET = string.ascii_letters + string.digits + " .,;:!?'-()"


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

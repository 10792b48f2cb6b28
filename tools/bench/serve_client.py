"""The workloads of ``tools.bench.serve``, the client that sends them, and their figures.

Three workloads (seeded: the same text for every configuration):

    shared   a shared system prompt followed by a short user turn; every
             ``unique_every``-th request instead has a prompt of the same length
             that shares no prefix. Request 0 (shared prefix) runs alone first,
             the rest from ``concurrency`` client threads. Text completions.
    unique   every prompt shares no prefix with another; all from
             ``concurrency`` client threads. Text completions.
    chat     S sessions of T turns over ``/v1/chat/completions``. Every
             session starts with the same system message; each turn resends
             the whole conversation so far (system, user 1, assistant reply 1,
             user 2, ...) with the reply the server streamed for the previous
             turn. The turns of one session run one after another; the
             sessions run concurrently, or from fewer client threads
             (``--chat-concurrency``) that each take the session that has
             waited longest.

Every request is streamed (temperature 0, ``max_tokens``, usage included):
the client stamps the arrival of every chunk that carries text. A record's
"warm" flag says whether the request could find its prefix cached: a
shared-prefix request after the first, or a chat turn after the first.
"""

from __future__ import annotations

import itertools
import json
import random
import string
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import httpx

# printable ASCII, without the characters of the demo tokenizer's special
# tokens ("<|end|>" and the like), so a random text never spells one
ALPHABET = string.ascii_letters + string.digits + " .,;:!?'-()"
WORKLOADS = ("shared", "unique", "chat")


# ------------------------------------------------------------------ workloads
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
    is a unique prompt of the same length distribution. unique_every=1: all unique."""
    rng = random.Random(f"bench_serve-{seed}")
    system = "System: " + _text(rng, max(0, system_chars - 8))
    out = []
    for i in range(n):
        user = "\nUser: " + _text(rng, rng.randint(24, 159)) + "\nAssistant:"
        unique = unique_every > 0 and i % unique_every == unique_every - 1
        head = _text(rng, len(system)) if unique else system
        out.append(Req(i, head + user, not unique))
    return out


@dataclass(frozen=True)
class ChatWorkload:
    """S sessions of T user turns; the assistant turns come from the server."""
    system: str
    user_turns: tuple[tuple[str, ...], ...]      # [session][turn]

    @property
    def sessions(self) -> int:
        return len(self.user_turns)

    @property
    def turns(self) -> int:
        return len(self.user_turns[0]) if self.user_turns else 0


def build_chat(sessions: int, turns: int, seed: int = 0, system_chars: int = 400,
               user_chars: tuple[int, int] = (40, 120)) -> ChatWorkload:
    rng = random.Random(f"bench_serve-chat-{seed}")
    system = _text(rng, system_chars)
    users = tuple(tuple(_text(rng, rng.randint(*user_chars)) for _ in range(turns))
                  for _ in range(sessions))
    return ChatWorkload(system, users)


def warmup_prompts(k: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"bench_serve-warmup-{seed}")
    return [_text(rng, 200) for _ in range(k)]


# ------------------------------------------------------------------ client
def _stream(client: httpx.Client, url: str, path: str, body: dict, timeout: float) -> dict:
    """POST one streamed request; stamp every chunk that carries text."""
    body = dict(body, temperature=0, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    usage = None
    with client.stream("POST", url + path, json=body, timeout=timeout) as r:
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
                piece = ch.get("text")
                if piece is None:
                    piece = (ch.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    parts.append(piece)
            if ev.get("usage"):
                usage = ev["usage"]
    t1 = time.perf_counter()
    usage = usage or {}
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft_s": stamps[0] - t0 if stamps else None, "latency_s": t1 - t0,
            "t_start": t0, "t_end": t1, "text": "".join(parts), "gaps_s": gaps,
            "max_gap_s": max(gaps) if gaps else None,
            "completion_tokens": usage.get("completion_tokens", len(stamps)),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int,
                timeout: float) -> dict:
    """One streamed text completion (``/v1/completions``)."""
    return _stream(client, url, "/v1/completions",
                   {"prompt": prompt, "max_tokens": max_tokens}, timeout)


def chat_request(client: httpx.Client, url: str, messages: list[dict], max_tokens: int,
                 timeout: float) -> dict:
    """One streamed chat completion (``/v1/chat/completions``)."""
    return _stream(client, url, "/v1/chat/completions",
                   {"messages": messages, "max_tokens": max_tokens}, timeout)


def _threads(n: int, target: Callable[[], None]) -> None:
    ts = [threading.Thread(target=target, daemon=True) for _ in range(max(1, n))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def run_workload(client: httpx.Client, urls: list[str], reqs: list[Req], concurrency: int,
                 max_tokens: int, timeout: float,
                 first_alone: bool = True) -> tuple[list[dict], float]:
    """Request 0 alone (first_alone), then the rest from concurrency threads;
    request i goes to urls[i % len(urls)]. Returns (per-request records, wall seconds)."""
    results: list[Optional[dict]] = [None] * len(reqs)
    first_warm = 1 if first_alone else 0

    def do(i: int) -> None:
        q = reqs[i]
        rec = {"idx": i, "shared": q.shared, "warm": q.shared and i >= first_warm,
               "server": i % len(urls)}
        try:
            rec.update(one_request(client, urls[i % len(urls)], q.prompt, max_tokens, timeout))
        except Exception as e:  # noqa: BLE001 - recorded, counted as a failure
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["t_end"] = time.perf_counter()
        results[i] = rec

    t0 = time.perf_counter()
    start = 0
    if reqs and first_alone:
        do(0)
        start = 1
    todo = iter(range(start, len(reqs)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            do(i)

    _threads(concurrency, worker)
    wall = max((r["t_end"] for r in results if r), default=t0) - t0
    return results, wall


def sticky_server(session: int, n_servers: int, how: str = "balanced") -> int:
    """The server a session is pinned to: "balanced" gives session s server
    s mod N (a balancer that assigns a new session round-robin and then keeps
    it there); "hash" gives crc32 of the session's name mod N (a hashing
    balancer: sessions may collide on one server)."""
    if how == "hash":
        return zlib.crc32(f"session-{session}".encode()) % n_servers
    return session % n_servers


def run_chat(client: httpx.Client, urls: list[str], chat: ChatWorkload, max_tokens: int,
             timeout: float, route: str = "round-robin",
             sticky: str = "balanced", concurrency: Optional[int] = None) -> tuple[list[dict], float]:
    """The sessions' turns from ``concurrency`` client threads (default: one
    per session, every session in flight at once), the turns of one session
    in order. A thread takes the session that has waited longest: at the
    start the sessions in order, then each session goes to the back of the
    queue when its turn's reply has arrived, so with fewer threads than
    sessions a session "thinks" while the others' turns run (many users,
    each between two messages, as on a chat service). route: "round-robin"
    (request k of the run, in the order sent, to urls[k mod N]) or "sticky"
    (every turn of session s to :func:`sticky_server`)."""
    results: list[dict] = []
    lock = threading.Lock()
    ready = threading.Condition(lock)
    counter = itertools.count()
    queue = deque((s, [{"role": "system", "content": chat.system}], 0)
                  for s in range(chat.sessions))
    in_flight = [0]

    def next_turn():
        with ready:
            while not queue and in_flight[0]:
                ready.wait()
            if not queue:
                return None
            in_flight[0] += 1
            return queue.popleft()

    def client_loop() -> None:
        while True:
            item = next_turn()
            if item is None:
                return
            s, messages, t = item
            messages.append({"role": "user", "content": chat.user_turns[s][t]})
            with lock:
                k = next(counter)
            srv = (sticky_server(s, len(urls), sticky) if route == "sticky"
                   else k % len(urls))
            rec = {"session": s, "turn": t, "warm": t > 0, "server": srv}
            try:
                rec.update(chat_request(client, urls[srv], list(messages), max_tokens,
                                        timeout))
            except Exception as e:  # noqa: BLE001 - recorded; the session ends
                rec["error"] = f"{type(e).__name__}: {e}"
                rec["t_end"] = time.perf_counter()
            with ready:
                results.append(rec)
                in_flight[0] -= 1
                if "error" not in rec and t + 1 < chat.turns:
                    messages.append({"role": "assistant", "content": rec["text"]})
                    queue.append((s, messages, t + 1))
                ready.notify_all()

    t0 = time.perf_counter()
    _threads(min(concurrency or chat.sessions, chat.sessions), client_loop)
    wall = max((r["t_end"] for r in results), default=t0) - t0
    return results, wall


# ------------------------------------------------------------------ figures
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
    """One run's figures. cold: requests that could not find their prefix
    cached (turn 1, a unique prompt, the first shared-prefix request); warm:
    the others. itl_p99: the 99th percentile of all gaps between two text
    chunks of one reply; max_gap_p50: the median over replies of a reply's
    longest gap."""
    ok = [r for r in records if "error" not in r]
    warm = [r for r in ok if r["warm"]]
    cold = [r for r in ok if not r["warm"]]
    tok = sum(r["completion_tokens"] or 0 for r in ok)

    def ttfts(rs):
        return [r["ttft_s"] for r in rs if r["ttft_s"] is not None]

    def mean_cached(rs):
        c = [r["cached_tokens"] for r in rs if r.get("cached_tokens") is not None]
        return sum(c) / len(c) if c else None

    gaps = [g for r in ok for g in r["gaps_s"]]
    max_gaps = [r["max_gap_s"] for r in ok if r["max_gap_s"] is not None]
    prompts = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    return {"requests": len(records), "errors": len(records) - len(ok),
            "generated_tokens": tok, "wall_s": wall,
            "throughput": tok / wall if wall > 0 else None,
            "ttft_cold_p50": pct(ttfts(cold), 0.5), "ttft_cold_p90": pct(ttfts(cold), 0.9),
            "ttft_warm_p50": pct(ttfts(warm), 0.5), "ttft_warm_p90": pct(ttfts(warm), 0.9),
            "itl_p99": pct(gaps, 0.99), "max_gap_p50": pct(max_gaps, 0.5),
            "max_gap_max": max(max_gaps) if max_gaps else None,
            "n_cold": len(cold), "n_warm": len(warm),
            "cached_tokens_warm": mean_cached(warm), "cached_tokens_cold": mean_cached(cold),
            "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None}

"""Prometheus metrics of one ``shmcache serve`` app (a registry per app, so
several apps in one process, as in the tests, do not collide).

Request-side metrics are counted by the HTTP layer; the pool and worker
gauges are read from ``backend.stats()`` at each scrape.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

log = logging.getLogger("shmcache.server")

PREFIX = "shmcache"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)

# backend.stats() key -> (metric name, kind, help)
BACKEND_STATS = (
    ("blocks_total", "pool_blocks_total", "gauge", "KV blocks in the shared pool"),
    ("blocks_used", "pool_blocks_used", "gauge", "KV blocks in use by running requests"),
    ("blocks_free", "pool_blocks_free", "gauge",
     "KV blocks free: neither used nor holding cached data (inspect_pool.block_usage)"),
    ("blocks_cached", "pool_blocks_cached", "gauge",
     "KV blocks holding reusable prefix-cache data"),
    ("pool_kv_bytes", "pool_kv_bytes", "gauge",
     "bytes of K/V held by the pool's used and cached blocks (shared by every worker)"),
    ("working_bytes", "working_kv_bytes", "gauge",
     "bytes of the workers' private K/V working buffers (the running batches)"),
    ("pool_prefix_hit_rate", "pool_prefix_hit_rate", "gauge",
     "prompt blocks found in the pool over prompt blocks looked up, since the pool was made "
     "(the pool's counters, as shmcache inspect shows them)"),
    ("lock_holds", "pool_lock_holds", "counter",
     "holds of the pool lock that ended cleanly, by every process of the pool"),
    ("lock_wait_max", "pool_lock_wait_max_seconds", "gauge",
     "longest wait for the pool lock seen since the pool was made"),
    ("lock_queue", "pool_lock_queue", "gauge", "operations waiting for their turn at the pool lock"),
    ("preemptions", "preemptions", "counter", "requests preempted for lack of pool blocks"),
    ("worker_restarts", "worker_restarts", "counter", "worker processes restarted after dying"),
    ("prefill_handoffs", "prefill_handoffs", "counter",
     "prompts prefilled on one worker and handed over, through the pool, to a decoding one "
     "(--handoff-tokens)"),
    ("workers_alive", "workers_alive", "gauge", "worker processes alive"),
    # the L2 (Redis) tier: present with --l2 only
    ("l2_up", "l2_up", "gauge", "1 while every worker finds the L2 (Redis) answering, 0 in an "
     "outage"),
    ("l2_lookups", "l2_lookups", "counter", "L2 lookups (prompts with blocks beyond the L1 hit)"),
    ("l2_hits", "l2_hits", "counter", "KV blocks loaded from L2"),
    ("l2_misses", "l2_misses", "counter",
     "KV blocks looked up in L2 and not found there (computed)"),
    ("l2_read_bytes", "l2_read_bytes", "counter", "bytes of the values loaded from L2"),
    ("l2_writes", "l2_writes", "counter", "KV blocks written to L2"),
    ("l2_written_bytes", "l2_written_bytes", "counter", "bytes written to L2"),
    ("l2_dropped", "l2_dropped", "counter",
     "KV blocks not written to L2 (its queue full, or L2 down or refusing writes)"),
    ("l2_rejected", "l2_rejected", "counter",
     "L2 values rejected (corrupt, truncated, another layout or key)"),
    ("l2_timeouts", "l2_timeouts", "counter", "L2 operations that timed out"),
    ("l2_errors", "l2_errors", "counter", "L2 operations that failed otherwise"),
    ("l2_outages", "l2_outages", "counter", "times the L2 became unavailable"),
)


class _BackendCollector:
    """Reads ``stats()`` at scrape time; a failing ``stats()`` leaves these
    metrics out of that scrape instead of failing it."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def _families(self, values: dict):
        for key, name, kind, doc in BACKEND_STATS:
            fam: Metric
            if kind == "counter":
                fam = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            else:
                fam = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            if values is not None:
                if key not in values:
                    continue
                fam.add_metric([], float(values[key]))
            yield fam
        per_worker = GaugeMetricFamily(f"{PREFIX}_worker_requests_running",
                                       "samples a worker is decoding now (its prefill is done)",
                                       labels=["worker"])
        if values is not None:
            for idx, n in sorted(values.get("worker_running", {}).items()):
                per_worker.add_metric([str(idx)], float(n))
        yield per_worker
        threads = GaugeMetricFamily(f"{PREFIX}_worker_blas_threads",
                                    "BLAS threads a worker runs (idle workers' cores are lent "
                                    "to busy ones)", labels=["worker"])
        if values is not None:
            for idx, n in sorted(values.get("worker_blas_threads", {}).items()):
                threads.add_metric([str(idx)], float(n))
        yield threads

    def describe(self):
        return list(self._families(None))

    def collect(self):
        try:
            values = dict(self._stats())
        except Exception:
            log.exception("backend.stats() failed; pool metrics left out of this scrape")
            return []
        return list(self._families(values))


class Metrics:
    def __init__(self, backend_stats: Callable[[], dict]):
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status "
                                "(499: the client went away first)",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge(f"{PREFIX}_requests_running",
                             "generation requests in progress", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens",
                                     "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "tokens generated", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_prompt_tokens",
                                     "prompt tokens served from the shared prefix cache",
                                     registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "seconds from receiving a request to its first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.hit_rate = Gauge(f"{PREFIX}_prefix_cache_hit_rate",
                              "cached prompt tokens / prompt tokens of this server's requests, "
                              "since start (see also shmcache_pool_prefix_hit_rate)", registry=r)
        self._lock = threading.Lock()
        self._prompt = 0
        self._cached = 0
        self.hit_rate.set_function(self._hit_rate)
        r.register(_BackendCollector(backend_stats))

    def _hit_rate(self) -> float:
        with self._lock:
            return self._cached / self._prompt if self._prompt else 0.0

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        with self._lock:
            self._prompt += prompt_tokens
            self._cached += cached_tokens

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

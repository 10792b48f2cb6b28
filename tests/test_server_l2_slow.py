"""A slow Redis never stalls a worker's other requests (issue 29, item 3).

A real ``shmcache serve`` with one worker, ``--l2`` pointing at a real
``redis-server`` (``tests/_redis.py``; skipped, with the reason, where there
is none) behind :class:`~_drip_proxy.DripProxy` dripping a few bytes a
second. One request streams; another, whose prompt misses L1, waits for its
L2 lookup meanwhile. The lookup costs that request at most its deadline
(``--l2-timeout``), the stream keeps getting tokens all along, and both
answers are mlx-lm's.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from _drip_proxy import DripProxy
from _redis import redis_or_skip
from _serve_proc import MODEL_NAME, got, printable, serving
from _serve_proc import model_dir, reference  # pytest fixtures

__all__ = ["model_dir", "reference"]

pytestmark = pytest.mark.redis

DEADLINE = 0.3


@pytest.mark.timeout(120)
def test_a_dripping_redis_costs_one_deadline_and_never_stalls_the_stream(model_dir, reference):
    redis_srv = redis_or_skip()
    proxy = DripProxy("127.0.0.1", redis_srv.port, rate=None)
    try:
        # 64-token blocks: the stream (2 + 60 tokens) fills none, so nothing of
        # it is written back through the drip (a slow write-back marks Redis
        # down, and then the lookup under test would not even be tried)
        with serving(model_dir, "--workers", 1, "--block-size", 64, "--max-blocks", 64,
                     "--l2", proxy.url,
                     "--l2-timeout", DEADLINE, "--l2-retry", 0.2) as srv:
            client = srv.client()
            rng = random.Random(29)
            warm = printable(rng, 40)
            client.completions.create(model=MODEL_NAME, prompt=warm, max_tokens=2,
                                      temperature=0)             # loads, connects
            # the same request with Redis fast: what the slow one may add to
            slow_prompt, fast_prompt = printable(rng, 70), printable(rng, 70)
            t0 = time.monotonic()
            r = client.completions.create(model=MODEL_NAME, prompt=fast_prompt, max_tokens=4,
                                          temperature=0)
            fast_s = time.monotonic() - t0
            assert got(r) == reference.greedy(fast_prompt, 4)

            time.sleep(0.5)                                       # its write-back done
            lookups = srv.metrics().get("shmcache_l2_lookups_total", 0)
            proxy.rate = 4                                        # bytes per second
            stream_prompt = printable(rng, 2)
            arrivals: list = []
            text: list = []

            def stream():
                s = client.completions.create(model=MODEL_NAME, prompt=stream_prompt,
                                              max_tokens=60, temperature=0, stream=True)
                for ev in s:
                    arrivals.append(time.monotonic())
                    text.append(ev.choices[0].text)

            th = threading.Thread(target=stream)
            th.start()
            while len(arrivals) < 5:
                assert th.is_alive(), "the stream ended early"
                time.sleep(0.01)
            t0 = time.monotonic()
            r = client.completions.create(model=MODEL_NAME, prompt=slow_prompt, max_tokens=4,
                                          temperature=0)
            t1 = time.monotonic()
            th.join(60)
            assert got(r) == reference.greedy(slow_prompt, 4)
            assert "".join(text) == reference.greedy(stream_prompt, 60).text
            # one deadline (plus the same work as with Redis fast), not the drip's ~10 s
            assert DEADLINE - 0.05 < t1 - t0 < fast_s + DEADLINE + 1.0, (t1 - t0, fast_s)
            # the stream kept going while the lookup waited
            during = [t for t in arrivals if t0 - 0.5 <= t <= t1 + 0.5]
            gaps = [b - a for a, b in zip(during, during[1:])]
            assert len(during) > 3 and max(gaps) < DEADLINE + 0.5, gaps
            # the lookup really went through the drip and timed out
            time.sleep(1.0)                                       # the next Load report
            m = srv.metrics()
            l2 = {k: v for k, v in m.items() if "l2" in k}
            assert m.get("shmcache_l2_lookups_total", 0) == lookups + 1, l2
            assert m.get("shmcache_l2_timeouts_total", 0) >= 1, l2
            print(f"fast {fast_s:.3f} s, slow {t1 - t0:.3f} s, stream gaps max "
                  f"{max(gaps):.3f} s over {len(during)} tokens")
    finally:
        proxy.close()
        redis_srv.stop()

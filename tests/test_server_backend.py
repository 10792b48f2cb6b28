"""End-to-end tests of ``shmcache serve``'s supervisor
(``workers.supervisor.backend`` and ``worker_procs``): the least-loaded routing
sends a request to another worker, which finds the prefix in the shared pool;
a worker killed mid-request is restarted and its request re-run; a long
prompt is prefilled on an idle worker and handed over to a decoding one.

The server is a real subprocess with real workers (``tests/_serve_proc.py``
says how, and how it is checked and stopped).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tools.bench import step_logs
from workers.supervisor.worker_procs import BLAS_SPIN, BLAS_SPIN_ENV

from _serve_proc import BS, MODEL_NAME, STARTUP_S, _is_running, got, printable, serving
from _serve_proc import model_dir, reference  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["model_dir", "reference"]


@pytest.fixture(scope="module")
def two_workers(model_dir):
    # the least-loaded routing (no prefill handoff, which packs decoding rows)
    with serving(model_dir, "--workers", 2, "--max-blocks", 256, "--handoff-tokens", 0) as srv:
        yield srv


# -------------------------------------------------------------------- tests
@pytest.mark.timeout(300)
def test_shared_prefix_is_reused_across_workers(two_workers, reference):
    """Worker 0 computes a 200-token prefix; while it is busy with a long
    request, the least-loaded routing sends the next requests with that prefix
    to worker 1, which must find the prefix's 12 full blocks in the pool."""
    srv = two_workers
    client = srv.client()
    assert len(srv.worker_procs()) == 2
    rng = random.Random(303)
    prefix = printable(rng, 200)
    full = len(prefix) // BS * BS
    suffixes = [printable(rng, k) for k in (7, 11, 19, 30, 3)]
    hit_rate_before = srv.metric("shmcache_prefix_cache_hit_rate")

    first = prefix + suffixes[0]
    r = client.completions.create(model=MODEL_NAME, prompt=first, max_tokens=16, temperature=0)
    assert got(r) == reference.greedy(first, 16)
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    # keep worker 0 (the idle server's first pick) busy with a long stream
    busy_prompt = printable(rng, 24)
    busy = client.completions.create(model=MODEL_NAME, prompt=busy_prompt, max_tokens=400,
                                     temperature=0, stream=True)
    it = iter(busy)
    busy_parts = [next(it).choices[0].text]     # it is running now

    def drain():
        for chunk in it:
            busy_parts.extend(c.text for c in chunk.choices)

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()

    def ask(suffix):
        p = prefix + suffix
        return p, client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=16,
                                            temperature=0)

    w0, w1 = srv.worker_procs()
    cpu = sum(w1.cpu_times()[:2])
    answers = [ask(suffixes[1])]                 # on worker 1
    assert sum(w1.cpu_times()[:2]) - cpu >= 0.01, "worker 1 did not serve it"
    with ThreadPoolExecutor(3) as ex:            # and a few at once, on either
        answers += list(ex.map(ask, suffixes[2:]))
    for p, r in answers:
        assert got(r) == reference.greedy(p, 16), f"prompt of {len(p)} tokens"
        assert r.usage.prompt_tokens_details.cached_tokens >= full, \
            f"prompt of {len(p)} tokens: {r.usage.prompt_tokens_details.cached_tokens} cached"
    drainer.join(120)
    assert not drainer.is_alive()
    assert "".join(busy_parts) == reference.greedy(busy_prompt, 400).text
    assert srv.metric("shmcache_prefix_cache_hit_rate") > hit_rate_before >= 0
    assert srv.metric("shmcache_cached_prompt_tokens_total") >= full * len(answers)
    # the pool lock, as the workers used it: held many times, nobody waiting now
    assert srv.metric("shmcache_pool_lock_holds_total") > len(answers)
    assert srv.metric("shmcache_pool_lock_queue") == 0
    assert 0 <= srv.metric("shmcache_pool_lock_wait_max_seconds") < 10
    # the prefix's blocks (and more) stay cached, with nothing in use
    assert srv.wait_idle()["cached"] >= full // BS


@pytest.mark.timeout(300)
def test_worker_killed_mid_request_is_rerun(model_dir, reference):
    """SIGKILL the worker running a long streaming request: the supervisor
    re-runs it on the other worker and drops what was already delivered, so
    the client gets one complete answer, equal to the reference."""
    with serving(model_dir, "--workers", 2, "--max-blocks", 256) as srv:
        client = srv.client()
        rng = random.Random(505)
        prompt = printable(rng, 40)
        ref = reference.greedy(prompt, 300)
        w0, w1 = srv.worker_procs()             # an idle server picks worker 0
        parts, reasons, killed_at = [], [], None
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=300,
                                               temperature=0, stream=True):
            for c in chunk.choices:
                parts.append(c.text)
                if c.finish_reason:
                    reasons.append(c.finish_reason)
            if killed_at is None and len("".join(parts)) >= 10:
                killed_at = len("".join(parts))
                w0.send_signal(signal.SIGKILL)
                assert srv.get("/health").status_code == 200
        assert killed_at is not None
        text = "".join(parts)
        assert len(text) == len(ref.text) and text == ref.text, \
            f"killed after {killed_at} chars; got {len(text)} chars, expected {len(ref.text)}"
        assert reasons == [ref.finish_reason]
        assert re.search(rf"worker 0 \(pid {w0.pid}\) died \(exit SIGKILL\); re-running its "
                         r"1 requests", srv.log()), srv.log()
        health = srv.get("/health")
        assert health.status_code == 200, health.text
        assert srv.metric("shmcache_worker_restarts_total") >= 1

        deadline = time.monotonic() + STARTUP_S
        while srv.get("/health").json()["workers_alive"] < 2:
            assert time.monotonic() < deadline, "worker 0 was not restarted"
            time.sleep(0.2)
        new = srv.worker_procs()
        assert [p.pid for p in new][1] == w1.pid and new[0].pid != w0.pid
        assert not _is_running(w0)
        assert srv.metric("shmcache_workers_alive") == 2

        after = printable(rng, 45)
        r = client.completions.create(model=MODEL_NAME, prompt=after, max_tokens=24,
                                      temperature=0)
        assert got(r) == reference.greedy(after, 24)
        # the killed worker's prompt blocks stayed in the pool
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                      temperature=0)
        assert got(r) == reference.greedy(prompt, 24)
        assert r.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BS * BS
        # nothing the killed worker held is still in use (reclaimed)
        assert srv.wait_idle()["cached"] > 0


@pytest.mark.timeout(300)
def test_a_new_shared_prefix_is_computed_once_and_spreads_over_workers(model_dir, reference,
                                                                       monkeypatch):
    """Four requests arrive together with a prefix nobody has computed. The
    first one computes it; the others wait for its blocks (not for that
    worker's queue) and then run on the least-loaded workers (the handoff
    off), so both workers serve while the prefix is computed once. /metrics
    shows the running samples per worker. The workers' OpenBLAS threads are
    told to sleep at once after a product (the operator set nothing)."""
    monkeypatch.delenv(BLAS_SPIN_ENV, raising=False)
    with serving(model_dir, "--workers", 2, "--max-blocks", 256, "--handoff-tokens", 0) as srv:
        client = srv.client()
        rng = random.Random(808)
        prefix = printable(rng, 300)
        full = (len(prefix)) // BS * BS
        prompts = [prefix + printable(rng, 5 + 9 * i) for i in range(4)]
        w0, w1 = srv.worker_procs()
        cpu = [sum(w.cpu_times()[:2]) for w in (w0, w1)]
        # the CPUs are shared out as BLAS threads
        share = str(max(1, len(os.sched_getaffinity(0)) // 2))
        assert [w.environ().get("SHMCACHE_BLAS_THREADS") for w in (w0, w1)] == [share] * 2
        assert [w.environ().get(BLAS_SPIN_ENV) for w in (w0, w1)] == [BLAS_SPIN] * 2

        def ask(p):
            return p, client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=40,
                                                temperature=0)

        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(ask, prompts))
        cached = sorted(r.usage.prompt_tokens_details.cached_tokens for _, r in answers)
        for p, r in answers:
            assert got(r) == reference.greedy(p, 40), f"prompt of {len(p)} tokens"
        # computed once: one request found nothing, every other one the whole prefix
        assert cached[0] < full and all(c >= full for c in cached[1:]), cached
        used = [sum(w.cpu_times()[:2]) - c for w, c in zip((w0, w1), cpu)]
        assert min(used) >= 0.05, f"a worker stayed idle: cpu seconds {used}"
        text = srv.get("/metrics").text
        for idx in (0, 1):
            assert f'shmcache_worker_requests_running{{worker="{idx}"}}' in text


def _blas_threads(text: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r'^shmcache_worker_blas_threads\{worker="(\d+)"\} ([0-9.]+)$', text, re.M)}


def test_core_shares_lend_idle_cores_to_decoding_workers_first():
    """(A pure function, no process.) 16 CPUs, 8 workers of 2 threads: the
    idle workers' cores go to the decoding workers, a worker that only
    prefills keeps its own share; with none decoding, the busy ones share
    them; the sum over busy workers never passes the CPUs."""
    from workers.supervisor.worker_procs import core_shares

    def shares(busy, decoding, n=8, cpus=16, base=2):
        out = core_shares([(i, i in busy, i in decoding) for i in range(n)], cpus, base)
        assert sum(out[i] for i in busy) <= cpus
        return out
    # 4 decode, 2 prefill, 2 idle: the idle ones' 4 cores, one to each decoder
    s = shares(busy={0, 1, 2, 3, 4, 5}, decoding={0, 1, 2, 3})
    assert [s[i] for i in range(8)] == [3, 3, 3, 3, 2, 2, 2, 2]
    # 4 decode, 4 idle: 4 threads each
    s = shares(busy={0, 1, 2, 3}, decoding={0, 1, 2, 3})
    assert [s[i] for i in range(4)] == [4] * 4
    # one long prompt on an idle server: all the CPUs
    s = shares(busy={5}, decoding=set())
    assert s[5] == 16 and s[0] == 2
    # everyone busy: each its own share; nobody busy: the same
    assert set(shares(busy=set(range(8)), decoding={0}).values()) == {2}
    assert set(shares(busy=set(), decoding=set()).values()) == {2}
    # 3 decoding on 16: 10 cores to lend, 3 more each (one left over)
    s = shares(busy={0, 1, 2}, decoding={0, 1, 2})
    assert [s[i] for i in range(3)] == [5, 5, 5]


@pytest.mark.timeout(300)
def test_idle_workers_lend_their_cores_to_the_busy_one(model_dir, reference):
    """--lend-cores, one request on 2 workers: each worker starts with half
    the CPUs as BLAS threads, and while only one has work it runs on all of
    them (the idle worker's share is lent: it makes no BLAS calls). The
    worker itself reports the thread count its BLAS runs, before the step
    that runs them, and /metrics shows it; idle again, it gives the lent
    cores back. The tokens are the same as with one thread."""
    with _lending(model_dir) as (srv, cpus, share):
        client = srv.client()
        prompt = printable(random.Random(5), 120)
        parts = []
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=300,
                                               temperature=0, stream=True):
            if not parts:
                # the worker serving it was told all the CPUs, and says it runs them
                assert sorted(_blas_threads(srv.get("/metrics").text).values()) == \
                    [share, cpus], srv.get("/metrics").text
            parts.extend(c.text for c in chunk.choices)
        assert "".join(parts) == reference.greedy(prompt, 300).text
        _threads_become(srv, [share, share])    # idle: the lent cores given back
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                      temperature=0)
        assert got(r) == reference.greedy(prompt, 24)


@contextlib.contextmanager
def _lending(model_dir):
    """A server of 2 workers with --lend-cores, once both report their own
    share of the CPUs: yields (server, CPUs, share). Skips with one CPU."""
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip(f"{cpus} CPU: nothing to lend")
    share = max(1, cpus // 2)
    with serving(model_dir, "--workers", 2, "--max-blocks", 256, "--lend-cores") as srv:
        _threads_become(srv, [share, share])
        yield srv, cpus, share


def _threads_become(srv, want: list, timeout: float = 30) -> None:
    """Wait until /metrics shows the workers' BLAS threads, sorted, as ``want``."""
    deadline = time.monotonic() + timeout
    while sorted(_blas_threads(srv.get("/metrics").text).values()) != want:
        assert time.monotonic() < deadline, srv.get("/metrics").text
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_borrower_killed_while_it_runs_lent_cores_loses_nothing(model_dir, reference):
    """--lend-cores (on by default where each worker has 2 CPUs or more): the
    worker running a request on the idle worker's cores too is killed
    mid-reply. The reply is re-run on the other worker and the client gets
    the reference's whole answer; the replacement starts with its own
    share, and once idle every worker is back to its share, so no core
    stays lent to a dead worker. The next request is answered right."""
    with _lending(model_dir) as (srv, cpus, share):
        client = srv.client()
        prompt = printable(random.Random(15), 90)
        ref = reference.greedy(prompt, 200)
        parts: list = []
        killed = None
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=200,
                                               temperature=0, stream=True):
            parts.extend(c.text for c in chunk.choices)
            if killed is None and len("".join(parts)) >= 10:
                threads = _blas_threads(srv.get("/metrics").text)
                borrower = max(threads, key=threads.get)
                assert threads[borrower] == cpus, threads        # it runs the lent cores
                killed = srv.worker_procs()[borrower]
                killed.send_signal(signal.SIGKILL)
        assert killed is not None
        assert "".join(parts) == ref.text
        deadline = time.monotonic() + STARTUP_S
        while srv.get("/health").json()["workers_alive"] < 2:
            assert time.monotonic() < deadline, "the killed worker was not restarted"
            time.sleep(0.2)
        assert killed.pid not in [p.pid for p in srv.worker_procs()]
        _threads_become(srv, [share, share])
        after = printable(random.Random(16), 40)
        r = client.completions.create(model=MODEL_NAME, prompt=after, max_tokens=16,
                                      temperature=0)
        assert got(r) == reference.greedy(after, 16)
        assert srv.wait_idle()["cached"] > 0


def _steps(path) -> list:
    """(start, end, threads, computes) of each step in an engine step log
    (read by ``tools.bench.step_logs``)."""
    return [(st["end"] - st["ms"] / 1000, st["end"], st["threads"], st["kind"] != "idle")
            for st in step_logs.parse(path)]


@pytest.mark.timeout(300)
def test_a_worker_gets_its_lent_cores_back_before_it_computes(model_dir, reference, tmp_path,
                                                              monkeypatch):
    """--lend-cores: worker A prefills a long prompt on all the CPUs (chunks
    of 128 tokens, one a step); meanwhile a second request goes to idle
    worker B. B's request is sent only once A has given back B's cores: from
    the workers' own step logs, no step of B that computes overlaps a step
    A ran with more than its share. Both answers are the reference's."""
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip(f"{cpus} CPU: nothing to lend")
    monkeypatch.setenv("SHMCACHE_STEP_TIMING", str(tmp_path))
    share = cpus // 2
    # chunks of 128 tokens: each step of A is far shorter than the wait's
    # limit (RECLAIM_WAIT_S), so B is sent only after A's report
    with serving(model_dir, "--workers", 2, "--max-blocks", 512, "--lend-cores",
                 "--prefill-step", 128) as srv:
        client = srv.client()
        long_prompt = printable(random.Random(8), 2000)
        short_prompt = printable(random.Random(9), 40)
        answers: dict = {}

        def ask(key, prompt, n):
            answers[key] = got(client.completions.create(model=MODEL_NAME, prompt=prompt,
                                                         max_tokens=n, temperature=0))
        a = threading.Thread(target=ask, args=("a", long_prompt, 8))
        a.start()
        deadline = time.monotonic() + 30
        while max(_blas_threads(srv.get("/metrics").text).values(), default=0) != cpus:
            assert time.monotonic() < deadline, srv.get("/metrics").text
            time.sleep(0.005)
        ask("b", short_prompt, 8)        # A is in its prefill, on all the CPUs
        a.join(120)
        assert answers == {"a": reference.greedy(long_prompt, 8),
                           "b": reference.greedy(short_prompt, 8)}
        pids = [p.pid for p in srv.worker_procs()]
    logs = {pid: _steps(tmp_path / f"engine-{pid}.log") for pid in pids
            if (tmp_path / f"engine-{pid}.log").exists()}
    assert len(logs) == 2, os.listdir(tmp_path)
    first = {pid: min(s for s, _, _, c in st if c) for pid, st in logs.items()}
    a_steps, b_steps = (logs[pid] for pid in sorted(first, key=first.get))
    lent = [(s, e) for s, e, t, c in a_steps if c and t > share]
    assert lent, "A never ran more than its share"
    tol = 0.0015                         # the log's clock: milliseconds
    b_work = [(s, e) for s, e, _, c in b_steps if c]
    # A was still computing when B started (else nothing was reclaimed)
    assert any(e > b_work[0][0] for s, e, t, c in a_steps if c), (a_steps, b_work[0])
    overlaps = [(bs, be, s, e) for bs, be in b_work for s, e in lent
                if s < be - tol and bs < e - tol]
    assert not overlaps, overlaps


@pytest.mark.timeout(300)
def test_decoding_prefill_step_reaches_the_workers_and_keeps_the_answers(model_dir, reference,
                                                                         tmp_path, monkeypatch):
    """--decoding-prefill-step 16: the worker runs with it; a 300-token
    prompt admitted while a reply streams on the same worker is computed in
    steps of at most one block (the worker's step log: no step with a
    running row computes more), and both answers are the reference's."""
    monkeypatch.setenv("SHMCACHE_STEP_TIMING", str(tmp_path))
    with serving(model_dir, "--workers", 1, "--max-blocks", 256,
                 "--decoding-prefill-step", BS) as srv:
        (proc,) = srv.worker_procs()
        assert proc.cmdline()[proc.cmdline().index("--decoding-prefill-step") + 1] == str(BS)
        client = srv.client()
        first, second = printable(random.Random(3), 20), printable(random.Random(4), 300)
        parts, answer = [], None
        # (a long reply: the row still runs when the second prompt arrives,
        # however slow this client is)
        for chunk in client.completions.create(model=MODEL_NAME, prompt=first, max_tokens=1000,
                                               temperature=0, stream=True):
            parts.extend(c.text for c in chunk.choices)
            if len(parts) == 5:
                answer = got(client.completions.create(model=MODEL_NAME, prompt=second,
                                                       max_tokens=8, temperature=0))
        assert "".join(parts) == reference.greedy(first, 1000).text
        assert answer == reference.greedy(second, 8)
    steps = step_logs.parse(str(tmp_path / f"engine-{proc.pid}.log"))
    chunked = [st for st in steps if st["kind"] == "prefill" and st["rows"] > 0]
    assert len(chunked) >= 300 // BS - 1, steps      # one block a step while the reply runs


@pytest.mark.timeout(180)
def test_prefill_threads_reach_the_workers_and_keep_the_answers(model_dir, reference,
                                                                monkeypatch):
    """--prefill-threads 3: the worker runs with it, installs the split (its
    log says so) and a 300-token prompt's answer is the reference's; by
    default the workers get the supervisor's choice."""
    from workers.supervisor.worker_procs import prefill_threads_per_worker
    monkeypatch.setenv("SHMCACHE_LOG_LEVEL", "info")
    with serving(model_dir, "--workers", 1, "--max-blocks", 256,
                 "--prefill-threads", 3) as srv:
        (proc,) = srv.worker_procs()
        assert proc.cmdline()[proc.cmdline().index("--prefill-threads") + 1] == "3"
        prompt = printable(random.Random(8), 300)
        answer = got(srv.client().completions.create(model=MODEL_NAME, prompt=prompt,
                                                     max_tokens=8, temperature=0))
        assert answer == reference.greedy(prompt, 8)
        assert "worker 0: prefill threads: 3" in srv.log()
    with serving(model_dir, "--workers", 2, "--max-blocks", 64) as srv:
        want = str(prefill_threads_per_worker(2))
        for proc in srv.worker_procs():
            assert proc.cmdline()[proc.cmdline().index("--prefill-threads") + 1] == want


@pytest.mark.timeout(120)
def test_an_empty_blas_threads_setting_starts_workers_with_their_share(model_dir, reference,
                                                                       monkeypatch):
    """SHMCACHE_BLAS_THREADS set but empty (as container env files write it)
    is no choice: the workers start with their share of the CPUs and serve.
    An OpenBLAS spin the operator did set is kept."""
    monkeypatch.setenv("SHMCACHE_BLAS_THREADS", "")
    monkeypatch.setenv(BLAS_SPIN_ENV, "12")
    with serving(model_dir, "--workers", 2, "--max-blocks", 64) as srv:
        share = str(max(1, len(os.sched_getaffinity(0)) // 2))
        assert [w.environ().get("SHMCACHE_BLAS_THREADS") for w in srv.worker_procs()] == \
            [share] * 2
        assert [w.environ().get(BLAS_SPIN_ENV) for w in srv.worker_procs()] == ["12"] * 2
        prompt = printable(random.Random(5), 20)
        r = srv.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                            temperature=0)
        assert got(r) == reference.greedy(prompt, 4)


def test_pinned_cpus_give_each_worker_its_share_in_order(monkeypatch):
    """``pinned_cpus``: this process's CPUs (not CPU numbers from 0: a cpuset
    may allow others) cut into equal shares in order, the rest unused; None
    where the workers outnumber the CPUs."""
    from workers.supervisor import worker_procs
    monkeypatch.setattr(worker_procs.os, "sched_getaffinity", lambda pid: {9, 3, 4, 5, 7})
    assert worker_procs.pinned_cpus(2) == [[3, 4], [5, 7]]
    assert worker_procs.pinned_cpus(5) == [[3], [4], [5], [7], [9]]
    assert worker_procs.pinned_cpus(6) is None


def _cpus_of(p) -> dict:
    """``{worker id: [its threads' CPU sets]}``, from /proc (every thread)."""
    idx = int(p.cmdline()[p.cmdline().index("--id") + 1])
    return {idx: sorted({tuple(os.sched_getaffinity(t.id)) for t in p.threads()})}


@pytest.mark.timeout(300)
def test_pinned_workers_run_on_cpus_of_their_own_and_a_replacement_on_the_same(
        model_dir, reference):
    """--pin-cores: every thread of each worker (BLAS, MLX, prefill) runs on
    that worker's share of the CPUs, none shared; no core is lent; a killed
    worker's replacement runs on the same CPUs, and the answers are the
    reference's."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"{len(cpus)} CPU: nothing to pin apart")
    share = len(cpus) // 2
    want = {0: [tuple(cpus[:share])], 1: [tuple(cpus[share:2 * share])]}
    with serving(model_dir, "--workers", 2, "--max-blocks", 64, "--pin-cores") as srv:
        assert re.search(rf"on {share} CPU\(s\) of its own \(--pin-cores\); idle workers' "
                         r"cores: not lent \(--pin-cores\)", srv.log()), srv.log()
        client = srv.client()
        prompt = printable(random.Random(21), 30)
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                      temperature=0)
        assert got(r) == reference.greedy(prompt, 8)
        w0, w1 = srv.worker_procs()
        assert {**_cpus_of(w0), **_cpus_of(w1)} == want
        _threads_become(srv, [share, share])        # its share of BLAS threads each

        w1.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + STARTUP_S
        while srv.get("/health").json()["workers_alive"] < 2 or \
                any(p.pid == w1.pid for p in srv.worker_procs()):
            assert time.monotonic() < deadline, "worker 1 was not restarted"
            time.sleep(0.2)
        new = [p for p in srv.worker_procs() if p.pid != w0.pid]
        assert len(new) == 1 and _cpus_of(new[0]) == {1: want[1]}
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                      temperature=0)
        assert got(r) == reference.greedy(prompt, 8)


def _running(text: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r'^shmcache_worker_requests_running\{worker="(\d+)"\} ([0-9.]+)$', text, re.M)}


@pytest.mark.timeout(300)
def test_a_long_prompt_is_prefilled_on_one_worker_and_decoded_on_the_fullest(
        model_dir, reference):
    """Prefill handoff, with real workers. Three long streams (short
    prompts: no handoff) run, two on worker 0 (the second one packed there
    once each worker has a request), one on worker 1. A 600-token prompt
    arrives: worker 1 (decoding fewer rows) computes it and hands it over,
    through the pool, to worker 0, which decodes it beside its two. The
    answers are the reference's, the client is told the prompt was not
    cached (the handoff's count, not the adopter's), /metrics counts one
    handoff, and once idle no block is held (the parked table was dropped).
    A later turn (a few new tokens) is not handed over."""
    with serving(model_dir, "--workers", 2, "--max-blocks", 256, "--handoff-tokens", 32) as srv:
        client = srv.client()
        rng = random.Random(909)
        streams = []
        for running in ({0: 1, 1: 0}, {0: 1, 1: 1}, {0: 2, 1: 1}):
            prompt = printable(rng, 20)
            it = iter(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1000,
                                                temperature=0, stream=True))
            streams.append((prompt, it, [next(it).choices[0].text]))
            assert _running(srv.get("/metrics").text) == running
        assert srv.metric("shmcache_prefill_handoffs_total") == 0
        long_prompt = printable(rng, 600)
        chunks = iter(client.completions.create(model=MODEL_NAME, prompt=long_prompt,
                                                max_tokens=400, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        parts = [next(chunks).choices[0].text]
        assert _running(srv.get("/metrics").text) == {0: 3, 1: 1}
        assert srv.metric("shmcache_prefill_handoffs_total") == 1
        usage = None
        for c in chunks:
            parts.extend(ch.text for ch in c.choices)
            usage = c.usage or usage
        assert "".join(parts) == reference.greedy(long_prompt, 400).text
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert "is gone" not in srv.log()        # adopted, not computed again

        later = long_prompt + printable(rng, 6)
        r = client.completions.create(model=MODEL_NAME, prompt=later, max_tokens=8,
                                      temperature=0)
        assert got(r) == reference.greedy(later, 8)
        assert r.usage.prompt_tokens_details.cached_tokens >= len(long_prompt) // BS * BS
        assert srv.metric("shmcache_prefill_handoffs_total") == 1
        for prompt, it, got_parts in streams:
            for chunk in it:
                got_parts.extend(c.text for c in chunk.choices)
            assert "".join(got_parts) == reference.greedy(prompt, 1000).text
        srv.wait_idle()


def _suspend_outside_the_pool_lock(srv, proc) -> None:
    """SIGSTOP ``proc`` at a moment it does not hold the pool lock (a stopped
    holder would stop every other process of the pool too): stop it, try
    the lock from here, and if it does not come, let it run a little and
    try again."""
    from shmcache.pool.inspect_pool import PoolView
    view = PoolView(srv.pool_path.rsplit("shmcache.", 1)[1])
    try:
        for _ in range(50):
            proc.suspend()
            with view.locked(timeout=0.5) as held:
                if held:
                    return
            proc.resume()
            time.sleep(0.01)
        raise AssertionError(f"worker {proc.pid} held the pool lock 50 times in a row")
    finally:
        view.close()


@pytest.mark.timeout(300)
def test_the_prefilling_worker_killed_before_its_prefill_is_adopted_loses_nothing(
        model_dir, reference):
    """The decoding worker (0) is stopped while a long prompt is prefilled
    on worker 1 and handed over to it; worker 1 is then SIGKILLed, its
    parked table reclaimed with it, and worker 0 continued: it finds no
    table to adopt and computes what the pool does not hold (the handed
    prefill's published blocks are cached). Every answer is the
    reference's (worker 1's stream re-run), and once idle nothing is held."""
    with serving(model_dir, "--workers", 2, "--max-blocks", 256, "--handoff-tokens", 32,
                 "--worker-timeout", 60) as srv:
        client = srv.client()
        rng = random.Random(919)
        streams = []
        for _ in range(3):                       # 2 on worker 0, 1 on worker 1
            prompt = printable(rng, 20)
            it = iter(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1000,
                                                temperature=0, stream=True))
            streams.append((prompt, it, [next(it).choices[0].text]))
        assert _running(srv.get("/metrics").text) == {0: 2, 1: 1}
        w0, w1 = srv.worker_procs()
        _suspend_outside_the_pool_lock(srv, w0)
        long_prompt = printable(rng, 600)
        answer: dict = {}

        def ask():
            answer["r"] = client.completions.create(model=MODEL_NAME, prompt=long_prompt,
                                                    max_tokens=24, temperature=0)

        asker = threading.Thread(target=ask, daemon=True)
        try:
            asker.start()
            deadline = time.monotonic() + 60
            while srv.metric("shmcache_prefill_handoffs_total") < 1:
                assert time.monotonic() < deadline, srv.log()
                time.sleep(0.02)
            w1.send_signal(signal.SIGKILL)
            # (counted once the dead worker's tables are reclaimed, the parked one too)
            while srv.metric("shmcache_worker_restarts_total") < 1:
                assert time.monotonic() < deadline, srv.log()
                time.sleep(0.02)
        finally:
            w0.resume()
        asker.join(120)
        assert not asker.is_alive()
        r = answer["r"]
        assert got(r) == reference.greedy(long_prompt, 24)
        assert re.search(r"worker 0: request \d+: its handed-over prefill \(table w1\.r\d+\.a0\.h\) "
                         r"is gone", srv.log()), srv.log()
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        for prompt, it, got_parts in streams:
            for chunk in it:
                got_parts.extend(c.text for c in chunk.choices)
            assert "".join(got_parts) == reference.greedy(prompt, 1000).text
        srv.wait_idle()

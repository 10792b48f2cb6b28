"""End-to-end tests of ``shmcache serve``: the real server, as a subprocess.

Each server here is ``python -m shmcache.cli serve --model DIR --port 0`` (its
URL is read from its startup log line) with real worker processes over a
real pool in /dev/shm, serving a small random-weight llama model built once
per module (``shmcache.demo_model.build_model_dir``). The clients are the
official ``openai`` client and raw ``httpx``.

The answers are checked against mlx-lm itself: greedy tokens must equal
``mlx_lm.generate.generate_step`` run in this process on the same model
directory with ``prefill_step_size`` = the block size (the engine prefills in
the same block-aligned chunks, so the tokens do not depend on what was cached,
which worker ran the request, or whether it was re-run after a worker died).
The demo tokenizer is byte-level (one token per byte), so the text and
``completion_tokens`` together pin the tokens down.

Every server is stopped by SIGTERM in a ``finally`` (SIGKILL, for it and its
workers, if it does not exit in time), and its teardown asserts that it
exited 0, that no worker survived it, and that its pool
(``/dev/shm/shmcache.serve-<pid>``) is gone; a pool left behind is unlinked
before the assertion fails, so /dev/shm stays clean either way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import shmcache  # noqa: F401  first, as in the workers: the same BLAS under MLX
import mlx.core as mx  # noqa: E402

MODEL_NAME = "tiny-llama"       # the model dir's name: the served model id
BS = 16                         # --block-size (the server's default)
STARTUP_S = 150                 # a loaded 2-core machine can be slow to load 2 workers
STOP_S = 20                     # SIGTERM/SIGINT to exit
REPO = Path(__file__).resolve().parents[1]
URL_RE = re.compile(r" on (http://\S+) \(OpenAI API at ")
PRINTABLE_IDS = list(range(0x20, 0x7F))   # the byte-level tokenizer: id == byte


def printable(rng: random.Random, n: int) -> list:
    return [rng.choice(PRINTABLE_IDS) for _ in range(n)]


# ---------------------------------------------------------------- reference
@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int                 # completion tokens, a final EOS included (as usage counts)
    finish_reason: str


class Reference:
    """mlx-lm's own greedy generation, in this process, on the same model dir."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load
        self.model, self.tokenizer = load(str(model_dir))
        self.eos = set(self.tokenizer.eos_token_ids)
        self._memo: dict = {}

    def greedy(self, prompt: list, max_tokens: int) -> Answer:
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            from mlx_lm.generate import generate_step
            toks = []
            for tok, _ in generate_step(mx.array(prompt), self.model, max_tokens=max_tokens,
                                        prefill_step_size=BS):
                toks.append(int(tok))
                if toks[-1] in self.eos:
                    break
            self._memo[key] = self.answer(toks)
        return self._memo[key]

    def answer(self, toks: list) -> Answer:
        """The text the server makes of these tokens (its streaming detokenizer)."""
        detok = self.tokenizer.detokenizer
        for t in toks:
            if t not in self.eos:
                detok.add_token(t)
        detok.finalize()
        stopped = bool(toks) and toks[-1] in self.eos
        return Answer(detok.text, len(toks), "stop" if stopped else "length")


def got(resp, i: int = 0) -> Answer:
    c = [c for c in resp.choices if c.index == i][0]
    return Answer(c.text, resp.usage.completion_tokens, c.finish_reason)


# ------------------------------------------------------------------- server
class Server:
    """``shmcache serve`` as a subprocess; ``stop()`` always leaves nothing behind."""

    def __init__(self, model_dir: Path, *args) -> None:
        cmd = [sys.executable, "-m", "shmcache.cli", "serve", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", "0", *map(str, args)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
        self.pool_path = f"/dev/shm/shmcache.serve-{self.proc.pid}"
        self.url: Optional[str] = None
        self.workers: list = []             # psutil.Process of every worker ever seen
        self._lines: list = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._stopped = False

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self._lines.append(line)
            m = URL_RE.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def wait_ready(self, timeout: float = STARTUP_S) -> "Server":
        if not self._ready.wait(timeout) or self.url is None:
            raise AssertionError(f"the server did not start in {timeout} s (exit "
                                 f"{self.proc.poll()}); its log:\n{self.log()}")
        self.worker_procs()
        return self

    def worker_procs(self) -> list:
        """The live worker processes (children of the server), by ``--id``."""
        found = []
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in kids:
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "shmcache.server.worker" in cmd:
                found.append(p)
                if all(p.pid != w.pid for w in self.workers):
                    self.workers.append(p)
        return sorted(found, key=lambda p: int(p.cmdline()[p.cmdline().index("--id") + 1]))

    def client(self, timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=timeout)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30)

    def metrics(self) -> dict:
        """/metrics: {sample name: value} (unlabelled samples)."""
        text = self.get("/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if not s.labels}

    def metric(self, name: str) -> float:
        m = self.metrics()
        assert name in m, f"no {name} in /metrics: {sorted(m)}"
        return m[name]

    def wait_idle(self, timeout: float = 30) -> dict:
        """The pool gauges once no block is in use (a worker releases a
        request's blocks just after sending its last token): then every
        block is either cached (reusable prefix data) or free."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            g = {k: m[f"shmcache_pool_blocks_{k}"] for k in ("total", "used", "cached", "free")}
            if g["used"] == 0:
                assert g["cached"] + g["free"] == g["total"], g
                return g
            assert time.monotonic() < deadline, f"pool blocks still in use when idle: {g}"
            time.sleep(0.1)

    def stop(self, *signals, gap: float = 0.05, timeout: float = STOP_S) -> list:
        """Sends the signals (default SIGTERM), waits for the exit, then makes
        sure that nothing is left; returns the problems found (empty: clean)."""
        if self._stopped:
            return []
        self._stopped = True
        problems = []
        self.worker_procs()
        rc = self.proc.poll()
        if rc is None:
            for i, s in enumerate(signals or (signal.SIGTERM,)):
                if i:
                    time.sleep(gap)
                self.proc.send_signal(s)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                problems.append(f"the server did not exit within {timeout} s of "
                                f"{signals or 'SIGTERM'}: killed")
                self.proc.kill()
                rc = self.proc.wait(30)
        if rc != 0:
            problems.append(f"the server exited with {rc}")
        _, alive = psutil.wait_procs(self.workers, timeout=10)
        alive = [p for p in alive if _is_running(p)]
        if alive:
            problems.append(f"worker processes survived the server: {[p.pid for p in alive]}")
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=10)
        left = self.segments()
        if left:
            problems.append(f"the server left segments in /dev/shm: {left}")
            for path in left:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._reader.join(10)
        self.proc.stdout.close()
        return problems


    def segments(self) -> list:
        """This server's files in /dev/shm: its pool, and anything named after it."""
        p = self.pool_path            # (not serve-<pid>*: that matches other pids too)
        return sorted(glob.glob(p) + glob.glob(f"{p}.*") + glob.glob(f"{p}-*"))


def _is_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def serving(model_dir: Path, *args):
    srv = Server(model_dir, *args)
    try:
        yield srv.wait_ready()
    finally:
        problems = srv.stop()
    assert not problems, "; ".join(problems) + "\n--- server log ---\n" + srv.log()


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from shmcache.demo_model import build_model_dir
    return build_model_dir(tmp_path_factory.mktemp("model") / MODEL_NAME, "llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def one_worker(model_dir):
    """One worker (so concurrent requests share its batch), a small pool."""
    with serving(model_dir, "--workers", 1, "--max-blocks", 64) as srv:
        yield srv


@pytest.fixture(scope="module")
def two_workers(model_dir):
    with serving(model_dir, "--workers", 2, "--max-blocks", 256) as srv:
        yield srv


# -------------------------------------------------------------------- tests
@pytest.mark.timeout(300)
def test_greedy_parity_with_mlx_lm_cold_and_warm(one_worker, reference):
    client = one_worker.client()
    rng = random.Random(101)
    # 40: a partial block after two full ones; 33: prompt[:-1] is exactly 2 blocks
    for length in (40, 33):
        prompt = printable(rng, length)
        ref = reference.greedy(prompt, 24)
        for run in ("cold", "warm"):
            r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                          temperature=0)
            assert got(r) == ref, f"{run} run of a {length}-token prompt"
            assert r.usage.prompt_tokens == length
            cached = r.usage.prompt_tokens_details.cached_tokens
            if run == "cold":
                assert cached == 0
            else:
                # the full blocks of prompt[:-1] come from the pool
                assert cached == (length - 1) // BS * BS > 0


@pytest.mark.timeout(300)
def test_concurrent_requests_in_one_batch_match_mlx_lm(one_worker, reference):
    """Four requests at once on one worker: decoded together in one batch
    (continuous batching: rows of different lengths that join at different
    steps and finish at different lengths); each must still equal its own
    batch-of-one mlx-lm reference. They are streamed, to check from outside
    that all four were generating at the same time (one worker runs one
    batch), i.e. that this tested batching at all."""
    client = one_worker.client()
    rng = random.Random(202)
    jobs = [(printable(rng, n), m) for n, m in ((21, 24), (37, 40), (50, 32), (64, 48))]
    refs = [reference.greedy(p, m) for p, m in jobs]
    start = threading.Barrier(len(jobs))

    def run(job):
        prompt, max_tokens = job
        start.wait()
        parts, reasons, times, usage = [], [], [], None
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                               max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.text:
                    parts.append(c.text)
                    times.append(time.monotonic())
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        assert len(reasons) == 1 and usage is not None
        return Answer("".join(parts), usage.completion_tokens, reasons[0]), times

    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(run, jobs))
    for i, ((answer, _), ref) in enumerate(zip(results, refs)):
        # NOTE: no tolerance for batched rounding: a batched step must give
        # the batch-of-one tokens (so far it does, exactly).
        assert answer == ref, f"request {i} (prompt {len(jobs[i][0])} tokens)"
    firsts = [t[0] for _, t in results]
    lasts = [t[-1] for _, t in results]
    assert max(firsts) < min(lasts), "the four requests never ran in one batch"


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
    # the prefix's blocks (and more) stay cached, with nothing in use
    assert srv.wait_idle()["cached"] >= full // BS


@pytest.mark.timeout(300)
def test_n2_seeded_sampling_is_reproducible_and_streams_the_same(one_worker):
    client = one_worker.client()
    prompt = printable(random.Random(404), 30)
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0.8, n=2)

    def texts(r):
        assert sorted(c.index for c in r.choices) == [0, 1]
        return [got(r, i).text for i in (0, 1)]

    a = texts(client.completions.create(seed=1234, **kw))
    b = texts(client.completions.create(seed=1234, **kw))
    assert a == b, "the same seed gave different samples"
    assert a[0] != a[1], "the two samples of one request are the same"
    assert texts(client.completions.create(seed=4321, **kw)) != a, "the seed is ignored"

    parts: dict = {0: [], 1: []}
    reasons: dict = {}
    chunks = 0
    for chunk in client.completions.create(seed=1234, stream=True, **kw):
        chunks += 1
        for c in chunk.choices:
            parts[c.index].append(c.text)
            if c.finish_reason:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    assert chunks > 2                       # streamed, not one blob
    assert ["".join(parts[0]), "".join(parts[1])] == a
    assert set(reasons) == {0, 1}


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
def test_prompt_the_pool_can_never_hold_is_a_400(one_worker, reference):
    """--max-blocks 64 (63 usable): a 64*16-token prompt cannot fit."""
    srv = one_worker
    client = srv.client()
    rng = random.Random(606)
    huge = printable(rng, 64 * BS)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=huge, max_tokens=8, temperature=0)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == "prompt"
    assert "blocks" in e.value.body["message"]

    # the raw body: OpenAI's error shape
    raw = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                     json={"model": MODEL_NAME, "prompt": huge, "max_tokens": 8})
    assert raw.status_code == 400
    body = raw.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"

    # a prompt that fits, with max_tokens that cannot: the fault is max_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=huge[:100], max_tokens=63 * BS,
                                  temperature=0)
    assert e.value.body["param"] == "max_tokens"

    # still serving, and correctly
    assert srv.get("/health").status_code == 200
    ok = printable(rng, 20)
    r = client.completions.create(model=MODEL_NAME, prompt=ok, max_tokens=16, temperature=0)
    assert got(r) == reference.greedy(ok, 16)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT,),
                                     (signal.SIGINT, signal.SIGINT)],
                         ids=["SIGTERM", "SIGINT", "SIGINT-twice"])
def test_signal_stops_the_server_cleanly(model_dir, reference, signals):
    """A signal arrives while a request streams. One SIGTERM/SIGINT: the
    request is given time to finish (it does, complete), then the server
    exits 0. A second SIGINT forces the exit: the request may be cut short
    with an error event. Either way: no traceback in the log (uvicorn's
    lifespan used to log a CancelledError on a forced exit), no worker left,
    no pool left in /dev/shm, within STOP_S."""
    srv = Server(model_dir, "--workers", 2, "--max-blocks", 128)
    try:
        srv.wait_ready()
        workers = srv.worker_procs()
        assert len(workers) == 2
        client = srv.client()
        prompt = printable(random.Random(707), 30)
        ref = reference.greedy(prompt, 100)
        result: dict = {}
        streaming = threading.Event()

        def stream():
            parts = []
            try:
                for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt,
                                                       max_tokens=100, temperature=0,
                                                       stream=True):
                    parts.extend(c.text for c in chunk.choices)
                    streaming.set()
                result["text"] = "".join(parts)
            except openai.APIError as e:
                result["error"] = e
            finally:
                streaming.set()

        th = threading.Thread(target=stream, daemon=True)
        th.start()
        assert streaming.wait(120) and not result
        assert os.path.exists(srv.pool_path)
        t0 = time.monotonic()
        problems = srv.stop(*signals)
        took = time.monotonic() - t0
        th.join(30)
        log = srv.log()
        assert not problems, "; ".join(problems) + "\n--- server log ---\n" + log
        assert took < STOP_S
        assert srv.proc.returncode == 0
        assert not srv.segments()
        assert not [p.pid for p in workers if _is_running(p)]
        assert "shmcache serve: stopped" in log
        assert "Traceback" not in log and "terminate called" not in log, log
        if len(signals) == 1:
            assert result.get("text") == ref.text, result
        else:
            assert (result.get("text") == ref.text
                    or "shutting down" in str(result.get("error"))), result
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.timeout(300)
def test_preempted_requests_still_match_mlx_lm(model_dir, reference):
    """A pool too small for four requests at once (23 usable blocks; each
    request needs 9 at its end, alone it fits): the worker preempts its
    newest request when a decode step finds no free block, re-runs it later
    from its prompt, and every answer still equals its mlx-lm reference."""
    rng = random.Random(707)
    jobs = [printable(rng, 40) for _ in range(4)]
    refs = [reference.greedy(p, 100) for p in jobs]
    with serving(model_dir, "--workers", 1, "--max-blocks", 24) as srv:
        client = srv.client()
        start = threading.Barrier(len(jobs))

        def run(prompt):
            start.wait()
            return got(client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                                 max_tokens=100))

        with ThreadPoolExecutor(len(jobs)) as ex:
            answers = list(ex.map(run, jobs))
        assert answers == refs
        assert srv.metric("shmcache_preemptions_total") >= 1, "the pool never ran short"

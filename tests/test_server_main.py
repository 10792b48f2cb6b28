"""``shmcache serve`` (``shmcache.server.main``): startup, the port, and
stopping on SIGTERM/SIGINT.

The first tests run the command in a subprocess with the fake backend of
``tests/_fake_backend.py`` standing in for ``WorkerBackend``; the last runs
the real server (worker processes, a pool in /dev/shm, the demo model) as
``tests/_serve_proc.py`` does, and checks that a signal leaves nothing
behind.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from _fake_backend import C, build_tokenizer
from _serve_proc import MODEL_NAME, STOP_S, Server, _is_running, printable
from _serve_proc import model_dir, reference  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["model_dir", "reference"]

# (the end-to-end test's own timeout marker, 240 s, is the one that applies to it)
pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------- `shmcache serve` (main.py)
SERVE_SCRIPT = r"""
import os, sys, types
import shmcache                            # before mlx (it sets up BLAS)
from pathlib import Path
sys.path.insert(0, os.environ["TESTS_DIR"])
from _fake_backend import FakeBackend, load_tokenizer

class WorkerBackend(FakeBackend):          # stands in for the real one: same constructor
    def __init__(self, model, workers, max_blocks, block_size, **options):
        super().__init__(load_tokenizer(Path(model)))
        self.log(f"built workers={workers} max_blocks={max_blocks} block_size={block_size}")
        self.hang_after = int(os.environ.get("HANG_AFTER", "-1"))
        if self.hang_after < 0:
            self.hang_after = None
    def log(self, line):
        with open(os.environ["MARKER"], "a") as f:
            f.write(line + "\n")
    async def start(self):
        self.log("started")
    async def close(self):
        self.log("closed")

mod = types.ModuleType("workers.supervisor.backend")
mod.WorkerBackend = WorkerBackend
sys.modules["workers.supervisor.backend"] = mod
from shmcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_serve(tmp_path, tokenizer_dir, *args, hang_after=None):
    import os
    import subprocess
    import sys
    marker = tmp_path / "marker"
    env = dict(os.environ, TESTS_DIR=str(Path(__file__).parent), MARKER=str(marker),
               HANG_AFTER=str(-1 if hang_after is None else hang_after))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, "serve", "--model", str(tokenizer_dir), *args],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    return proc, marker


def read_url(proc) -> tuple[str, list]:
    import re
    lines = []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"shmcache serve: .* on (http://127\.0\.0\.1:\d+) ", line)
        if found:
            return found.group(1), lines
    raise AssertionError("no startup line:\n" + "".join(lines))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-tokenizer")
    build_tokenizer(d)
    return d


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_serve_runs_and_stops_on_signal(tmp_path, tokenizer_dir, sig):
    import signal
    proc, marker = start_serve(tmp_path, tokenizer_dir, "--port", "0", "--workers", "3",
                               "--block-size", "8", "--max-blocks", "64")
    try:
        url, lines = read_url(proc)
        # one startup line, with the URL (and a warning when 3 workers are more than the CPUs)
        many = 3 > (os.cpu_count() or 1)
        assert len(lines) == 1 + many, lines
        assert not many or "more than the" in lines[0]
        assert marker.read_text().splitlines() == [
            "built workers=3 max_blocks=64 block_size=8", "started"]
        with httpx.Client(base_url=url, timeout=30) as h:
            assert h.get("/health").status_code == 200
            r = h.post(C, json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(20) == 0
        assert marker.read_text().splitlines()[-1] == "closed"
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_serve_stops_with_a_stream_in_flight(tmp_path, tokenizer_dir):
    import signal
    proc, marker = start_serve(tmp_path, tokenizer_dir, "--port", "0", hang_after=2)
    try:
        url, _ = read_url(proc)
        with httpx.Client(base_url=url, timeout=30) as h:
            with h.stream("POST", C, json={"prompt": "x", "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                # after the grace period the server cuts the stream off
                with pytest.raises(httpx.RemoteProtocolError):
                    list(lines)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 20
        assert marker.read_text().splitlines()[-1] == "closed"
    finally:
        proc.kill()
        proc.wait()


def test_serve_port_in_use(tmp_path, tokenizer_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc, marker = start_serve(tmp_path, tokenizer_dir, "--port",
                                   str(busy.getsockname()[1]))
        try:
            assert proc.wait(30) == 2
            err = proc.stderr.read().strip().splitlines()
        finally:
            proc.kill()
            proc.wait()
    assert len(err) == 1 and err[0].startswith("shmcache serve: error: cannot listen on"), err
    assert not marker.exists()                       # failed before building the backend


# --------------------------------------------- the real server, by signal
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


def test_url_at_every_log_level_workers_warning_and_request_log_lines(tmp_path, tokenizer_dir):
    """--log-level warning still prints the URL; --workers above the CPUs
    warns; at info, every request is one log line (a 400 with its reason)."""
    import signal
    many = (os.cpu_count() or 1) + 1
    proc, _ = start_serve(tmp_path, tokenizer_dir, "--port", "0", "--log-level", "warning",
                          "--workers", str(many))
    try:
        url, lines = read_url(proc)
        assert any(f"--workers {many} is more than the" in ln for ln in lines), lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()
    proc, _ = start_serve(tmp_path, tokenizer_dir, "--port", "0", "--workers", "1")
    try:
        url, _ = read_url(proc)
        with httpx.Client(base_url=url, timeout=30) as h:
            assert h.post(C, json={"prompt": "x", "max_tokens": 2}).status_code == 200
            assert h.post(C, json={"prompt": "x", "max_tokens": -1}).status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        log = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    ok = [ln for ln in log.splitlines() if "request /v1/completions 200" in ln]
    assert len(ok) == 1 and "tokens in 1 (cached 0) out 2" in ok[0] and "ttft" in ok[0], log
    bad = [ln for ln in log.splitlines() if "request /v1/completions 400" in ln]
    assert len(bad) == 1 and "reason: " in bad[0] and "max_tokens" in bad[0], log

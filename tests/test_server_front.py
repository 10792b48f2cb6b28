"""``shmcache serve`` as a user and an operator meet it, with real processes:
errors at startup (one line, exit 2), the default pool's size, Ctrl-C during
startup, SIGTERM during a stream (503 / an SSE error event), a SIGSTOPped
worker (heartbeat), a request that keeps killing its workers (re-runs
capped), and a server killed with SIGKILL restarting under the same pid
(pid 1 in a PID namespace, as in a container) over its dead pool.

The model is the demo model of ``tests/_serve_proc.py``; every process has a
hard timeout and is killed in a ``finally``. The namespace tests need
``unshare`` with user namespaces and are skipped without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from shmcache.shm import segment

from _serve_proc import MODEL_NAME, REPO, Server, printable, serving
from _serve_proc import model_dir, reference  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["model_dir", "reference"]

URL_RE = re.compile(r" on (http://\S+) \(OpenAI API at ")
SERVE = [sys.executable, "-m", "shmcache.cli", "serve"]


def _serve_once(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVE, "--port", "0", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def _one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "ERROR" in ln or "error:" in ln]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


# ------------------------------------------------------------ startup errors
@pytest.mark.timeout(120)
def test_model_errors_are_one_line_and_exit_2(model_dir, tmp_path):
    unknown = tmp_path / "unknown"
    shutil.copytree(model_dir, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-arch"}))
    _one_line_error(_serve_once("--model", unknown), "no-such-arch")

    noweights = tmp_path / "noweights"
    shutil.copytree(model_dir, noweights)
    for f in noweights.glob("*.safetensors"):
        f.unlink()
    _one_line_error(_serve_once("--model", noweights), "--model")

    sliding = tmp_path / "sliding"
    shutil.copytree(model_dir, sliding)
    n = cfg["num_hidden_layers"]
    sliding_cfg = {**cfg, "sliding_window": 32,
                   "layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"]}
    (sliding / "config.json").write_text(json.dumps(sliding_cfg))
    _one_line_error(_serve_once("--model", sliding), "RotatingKVCache")

    _one_line_error(_serve_once("--model", model_dir, "--chat-template", tmp_path / "none.j2"),
                    "--chat-template")
    # a pool bigger than /dev/shm: the fix is in the line
    free = shutil.disk_usage("/dev/shm").free
    line = _one_line_error(_serve_once("--model", model_dir, "--max-blocks",
                                       max(2, free // 256)), "--max-blocks")
    assert "shm-size" in line


# ------------------------------------------------------------ Ctrl-C at startup
@pytest.mark.timeout(120)
def test_ctrl_c_while_the_workers_load_stops_at_once(model_dir):
    srv = Server(model_dir, "--workers", "2")
    try:
        deadline = time.monotonic() + 60
        while "loading the model in" not in srv.log():
            assert srv.proc.poll() is None and time.monotonic() < deadline, srv.log()
            time.sleep(0.02)
        t = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        rc = srv.proc.wait(15)
        took = time.monotonic() - t
    finally:
        problems = srv.stop()
    assert rc == 0 and not problems, (problems, srv.log())
    assert "Traceback" not in srv.log() and srv.url is None, srv.log()
    assert took < 5, f"took {took:.1f} s to stop"


# ------------------------------------------------------- SIGTERM mid-stream
@pytest.mark.timeout(180)
def test_sigterm_during_a_stream_gives_the_client_a_503_event_and_chat_template(model_dir):
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    srv = Server(model_dir, "--workers", "1", "--chat-template", template).wait_ready()
    events = []
    try:
        # --chat-template: the prompt is "[hi]", 4 tokens of the byte-level tokenizer
        r = srv.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.prompt_tokens == 4
        # issue 29's bodies, on the real server: each refused with the right status, and a
        # 10 MB body does not hold up /health
        big = {"prompt": "a" * (10 << 20), "max_tokens": 1}
        t = time.monotonic()
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            assert h.post("/v1/completions", json=big).status_code == 413
            assert time.monotonic() - t < 10
            hdr = {"content-type": "application/json"}
            r = h.post("/v1/completions", headers=hdr,
                       content=b'{"prompt": "\\ud800", "max_tokens": 1}')
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                "top_k": 10 ** 9})
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
            r = h.post("/v1/completions", json={"prompt": [1] * 100_000, "max_tokens": 1})
            assert r.status_code == 400 and "context length" in r.text, r.text
            # the prompt plus max_tokens past the model's context (the demo model's 8192)
            r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 8192})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
            assert "context length of 8192" in r.text and "at most 8191" in r.text, r.text
            assert h.get("/v1/nope").json()["error"]["type"] == "invalid_request_error"
            assert h.put("/v1/completions").status_code == 405
        body = {"model": MODEL_NAME, "prompt": "x" * 20, "max_tokens": 8000,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 5:
                    srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
    finally:
        problems = srv.stop()
    assert rc == 0 and not problems, (problems, srv.log())
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert "shutting down" in err["message"] and err["type"] == "server_error"
    log = srv.log()
    assert "CancelledError" not in log and "Traceback" not in log, log


# ------------------------------------------------------- a stopped worker
@pytest.mark.timeout(240)
def test_a_sigstopped_worker_is_routed_around_then_restarted(model_dir, reference):
    with serving(model_dir, "--workers", "2", "--worker-timeout", "2") as srv:
        w0 = srv.worker_procs()[0]
        w0.suspend()
        try:
            t = time.monotonic()
            while srv.get("/health").json()["workers_alive"] != 1:
                assert time.monotonic() - t < 15, "the stopped worker is still routed to"
                time.sleep(0.1)
            import random
            rng = random.Random(4)
            client = srv.client(timeout=60)
            for i in range(4):
                prompt = printable(rng, 24)
                t = time.monotonic()
                r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                              temperature=0)
                assert r.choices[0].text == reference.greedy(prompt, 8).text
                assert time.monotonic() - t < 20
            t = time.monotonic()
            while srv.metric("shmcache_worker_restarts_total") < 1 or \
                    srv.get("/health").json()["workers_alive"] != 2:
                assert time.monotonic() - t < 60, srv.log()
                time.sleep(0.2)
            assert not w0.is_running() or w0.status() == psutil.STATUS_ZOMBIE
            assert "silent for" in srv.log()
            _inspect_agrees_with_metrics(srv)
        finally:
            with contextlib.suppress(psutil.Error):
                w0.resume()


def _inspect_agrees_with_metrics(srv):
    """``shmcache inspect`` and /metrics count free blocks and the pool's hit
    rate by one definition (``inspect_pool.block_usage``, ``prefix_hit_rate``)."""
    for _ in range(2):                 # the second finds the first's prompt blocks
        srv.client().completions.create(model=MODEL_NAME, prompt="z" * 40, max_tokens=1)
    g = srv.wait_idle()
    name = os.path.basename(srv.pool_path)[len("shmcache."):]
    r = subprocess.run([sys.executable, "-m", "shmcache.cli", "inspect", name, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    m = srv.metrics()
    for k in ("total", "used", "cached", "free"):
        assert d[f"blocks_{k}"] == g[k], (k, d[f"blocks_{k}"], g[k])
    assert d["prefix_hit_rate"] == pytest.approx(m["shmcache_pool_prefix_hit_rate"])
    assert 0 < d["prefix_hit_rate"] <= 1


# ------------------------------------------------------- a poison request
@pytest.mark.timeout(240)
def test_a_request_whose_workers_keep_dying_fails_after_the_reruns(model_dir):
    with serving(model_dir, "--workers", "1", "--max-reruns", "1") as srv:
        body = {"model": MODEL_NAME, "prompt": "y" * 20, "max_tokens": 8000,
                "temperature": 0, "stream": True}
        events, kills = [], []

        def killer():
            for _ in range(2):
                t = time.monotonic()
                while True:           # a live, ready worker that has the request
                    ws = srv.worker_procs()
                    if ws and ws[0].pid not in kills and \
                            srv.get("/health").json()["workers_alive"] == 1:
                        break
                    assert time.monotonic() - t < 90
                    time.sleep(0.1)
                time.sleep(0.5)
                kills.append(ws[0].pid)
                ws[0].kill()
        th = threading.Thread(target=killer, daemon=True)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            th.start()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        th.join(5)
        assert len(kills) == 2, kills
        err = json.loads(events[-2])["error"]
        assert "2 worker processes that died" in err["message"], err
        # the log line and the error event leave the server together; its
        # output reaches this process through a reader thread a moment later
        deadline = time.monotonic() + 10
        while "not run again" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "not run again" in srv.log()


# --------------------------------------- SIGKILL and restart under the same pid
def _unshare_ok() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--map-root-user",
                        "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=20)
    return r.returncode == 0 and r.stdout.strip() == "1"


class _NsServer:
    """``shmcache serve`` as pid 1 of a new PID namespace (``unshare``)."""

    def __init__(self, model_dir, *args, shell_prefix: str = ""):
        inner = " ".join([*SERVE, "--model", str(model_dir), "--port", "0", "--workers", "1",
                          *map(str, args)])
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--map-root-user", "sh", "-c",
             f"{shell_prefix}exec {inner}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True)
        self.lines, self.url = [], None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = URL_RE.search(line)
            if m:
                self.url = m.group(1)
                self.ready.set()
        self.ready.set()

    def log(self):
        return "".join(self.lines)

    def wait_ready(self, timeout=150):
        assert self.ready.wait(timeout) and self.url, self.log()
        return self

    def server_pid(self) -> int:
        """The server's host pid (pid 1 inside)."""
        kids = psutil.Process(self.proc.pid).children()
        return kids[0].pid

    def kill_all(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)


@pytest.mark.timeout(300)
def test_sigkilled_server_restarts_under_the_same_pid(model_dir):
    if not _unshare_ok():
        pytest.skip("unshare --pid --map-root-user is not available here")
    pool = segment.path_for("serve-1")
    if os.path.exists(pool):
        pytest.skip(f"{pool} exists already (another test's server?)")
    first = _NsServer(model_dir)
    second = None
    try:
        first.wait_ready()
        assert "pool serve-1:" in first.log()
        os.kill(first.server_pid(), signal.SIGKILL)        # pid 1: the namespace dies
        first.proc.wait(30)
        assert os.path.exists(pool), "the killed server's pool should be left behind"
        second = _NsServer(model_dir).wait_ready()
        assert "removed the dead pool serve-1" in second.log(), second.log()
        r = httpx.post(f"{second.url}/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        os.kill(second.server_pid(), signal.SIGTERM)
        assert second.proc.wait(30) == 0, second.log()
        assert not os.path.exists(pool)
    finally:
        first.kill_all()
        if second is not None:
            second.kill_all()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pool)


@pytest.mark.timeout(200)
def test_a_small_dev_shm_sizes_the_default_pool_and_doctor_warns(model_dir):
    """A private 64 MiB /dev/shm (Docker's default), in a mount namespace."""
    if not _unshare_ok():
        pytest.skip("unshare --pid --map-root-user is not available here")
    small = "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
    r = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                        small + " ".join([sys.executable, "-m", "shmcache.cli", "doctor",
                                          "--json", "--no-measure"])],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    if r.returncode != 0 and "mount" in r.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace: {r.stderr.strip()}")
    d = json.loads(r.stdout)
    assert any("/dev/shm" in w and "shm-size" in w for w in d["warnings"]), d
    srv = _NsServer(model_dir, shell_prefix=small)
    try:
        srv.wait_ready()
        line = [ln for ln in srv.lines if "pool:" in ln and "blocks of" in ln][0]
        assert "50% of /dev/shm's 64 MiB free" in line, line
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        os.kill(srv.server_pid(), signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.kill_all()
    # a pool that cannot fit at all: one line saying how to fix it
    tiny = "mount -t tmpfs -o size=256k tmpfs /dev/shm && "
    r = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                        tiny + " ".join([*SERVE, "--model", str(model_dir), "--port", "0"])],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    line = _one_line_error(r, "--max-blocks", "--shm-size")
    assert "smallest pool" in line


def test_choose_pool_blocks():
    """The default pool: 1 GiB of K/V when /dev/shm has room, else half its
    free space, metadata included; too little for 64 blocks: a how-to-fix."""
    from workers.supervisor.worker_procs import MIN_POOL_BLOCKS, PoolDoesNotFit, choose_pool_blocks
    per = 64 << 10
    n, why = choose_pool_blocks(per, 100 << 30)
    assert n == (1 << 30) // per and "default" in why
    n, why = choose_pool_blocks(per, 64 << 20, overhead=lambda b: 100 * b)
    assert n * (per + 100) <= 32 << 20 < (n + 1) * (per + 100) * 1.06 and "64 MiB free" in why
    with pytest.raises(PoolDoesNotFit, match="--shm-size=1g.*--max-blocks"):
        choose_pool_blocks(per, MIN_POOL_BLOCKS * per)


@pytest.mark.timeout(180)
def test_a_stream_without_a_first_token_gets_keepalives_and_a_progress_log(model_dir,
                                                                          reference):
    """The only worker is stopped (as a very long prefill looks from outside):
    the stream sends SSE comments, the log says how long the request has
    waited, and once the worker goes on the answer is mlx-lm's."""
    with serving(model_dir, "--workers", "1", "--worker-timeout", "60") as srv:
        w = srv.worker_procs()[0]
        prompt = "q" * 30
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "stream": True}
        comments, texts = 0, []
        w.suspend()
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body,
                              timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line == ": keep-alive":
                        comments += 1
                        if comments == 3:         # about 6 s: the progress line is due
                            t = time.monotonic()
                            while "no first token after 5 s" not in srv.log():
                                assert time.monotonic() - t < 10, srv.log()
                                time.sleep(0.1)
                            w.resume()
                    elif line.startswith("data: {"):
                        texts.append(json.loads(line[6:])["choices"][0]["text"])
        finally:
            with contextlib.suppress(psutil.Error):
                w.resume()
        assert comments >= 3
        assert "prefill 0 of 30 prompt tokens, no first token after 5 s" in srv.log()
        assert "".join(texts) == reference.greedy(list(prompt.encode()), 6).text

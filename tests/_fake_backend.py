"""The fake backend and the in-process server of the HTTP-layer tests
(``test_server_app``, ``test_server_responses``, ``test_server_sample_text``,
``test_server_validation``, ``test_server_main``).

The backend is a FAKE (no worker processes, no pool, no model): it replays
scripted text as token ids and records what it was asked and whether it was
closed. What is real: the tokenizer (the demo model's byte-level tokenizer,
built in a temporary directory and loaded by ``mlx_lm``, so a multi-byte
character spans several tokens), uvicorn serving the app on 127.0.0.1 in a
background thread, the official ``openai`` client, and raw ``httpx``.

The fixtures (``tokenizer``, ``served``, ``fake``, ``client``, ``http``) are
imported by name into the test modules that use them; ``tokenizer`` and
``served`` are module-scoped, so each such module builds one tokenizer and
runs one server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from shmcache.server.app import create_app
from workers.protocol import SampleDone, Started, TokenLogprob, Tokens


MODEL = "fake-model"
BLOCK = 4                        # the fake's prefix-cache granularity
C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def build_tokenizer(path: Path):
    """The demo model's tokenizer (one token per byte, special tokens, a chat
    template; mlx_lm streams it with its NaiveStreamingDetokenizer), from a
    tiny ``shmcache.models.demo_model`` directory: only its tokenizer is used here."""
    from shmcache.models.demo_model import build_model_dir
    build_model_dir(path, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return load_tokenizer(path)


def load_tokenizer(path: Path):
    """As ``mlx_lm.load`` loads a model directory's tokenizer."""
    from mlx_lm.tokenizer_utils import load
    eos = json.loads((Path(path) / "config.json").read_text()).get("eos_token_id")
    return load(Path(path), eos_token_ids=eos)


def default_reply(prompt, params, sample) -> str:
    return f"Hello world {sample}! café ☕ naïve end."


def fake_logprobs(ids, params) -> list:
    """The fake's log probabilities: token t gets -t/1000; its top
    alternatives are t itself, then t+1, t+2, ... (each 1 lower)."""
    return [TokenLogprob(-t / 1000, [(t + k, -t / 1000 - k) for k in range(params.top_logprobs)])
            for t in ids]


#: a chat template that renders ``tools``, the history's ``tool_calls`` and a
#: custom ``chat_template_kwargs`` variable (``greeting``), in the demo
#: model's turn format; its tool calls are mlx-lm's ``json_tools`` format
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% if tools %}<|system|>\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% for tc in message.tool_calls or [] %}<tool_call>{{ {'name': tc.function.name, "
    "'arguments': tc.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def use_tool_template(path: Path) -> None:
    """Gives a model directory's tokenizer :data:`TOOL_TEMPLATE` and mlx-lm's
    ``json_tools`` tool parser (``<tool_call>{json}</tool_call>``)."""
    f = Path(path) / "tokenizer_config.json"
    cfg = json.loads(f.read_text())
    cfg.update(chat_template=TOOL_TEMPLATE, tool_parser_type="json_tools")
    f.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


class FakeBackend:
    """Duck-types ``shmcache.server.api.Backend``. ``generate`` replays
    ``reply(prompt, params, sample)`` as byte tokens, ``chunk`` tokens per
    ``Tokens`` event, samples interleaved; stops at ``max_tokens``
    ("length") or at the end of the text ("stop"). Knobs: ``hang_after``
    (events, then wait forever), ``error``/``error_after`` (an ``Error``
    event), ``append_eos``, ``capacity`` (what ``admission_error`` allows).
    Each call is recorded in ``calls`` with how its generator ended."""

    model_id = MODEL
    max_n = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.started = self.closed = False
        self.reset()

    def reset(self):
        self.calls = []
        self.reply = default_reply
        self.chunk = 2
        self.delay = 0.0
        self.hang_after = None
        self.error = None
        self.error_after = 0
        self.error_first = None              # an Error instead of Started
        self.boom = None                     # an exception raised after Started
        self.bad_sample = False              # Tokens for a sample that does not exist
        self.append_eos = False
        self.capacity = 10_000
        self.seen = []                       # (salt, prompt) of earlier requests
        self.workers_alive = 2
        self.start_delay = 0.0               # seconds before Started (a long prefill)

    # ----------------------------------------------------------- Backend
    def admission_error(self, prompt_tokens, max_tokens, n):
        need = prompt_tokens + n * max_tokens
        if need > self.capacity:
            return f"the request needs {need} tokens of KV cache; the pool holds {self.capacity}"
        return None

    def stats(self):
        return {"blocks_total": 100, "blocks_used": 7, "blocks_free": 60, "blocks_cached": 33,
                "preemptions": 3, "worker_restarts": 1, "workers_alive": self.workers_alive}

    async def start(self):
        self.started = True

    async def close(self):
        self.closed = True

    def _cached(self, prompt, salt) -> int:
        best = 0
        for s, p in self.seen:
            if s != salt:
                continue
            k = 0
            while k < min(len(p), len(prompt) - 1) and p[k] == prompt[k]:
                k += 1
            best = max(best, k // BLOCK * BLOCK)
        self.seen.append((salt, list(prompt)))
        return best

    async def generate(self, prompt, params):
        rec = {"prompt": list(prompt), "params": params, "finished": False, "closed": None}
        self.calls.append(rec)
        try:
            if self.start_delay:
                await asyncio.sleep(self.start_delay)
            if self.error_first is not None:
                yield self.error_first
                return
            yield Started(prompt_tokens=len(prompt),
                          cached_tokens=self._cached(prompt, params.salt), worker=0)
            if self.boom is not None:
                raise self.boom
            if self.bad_sample:
                yield Tokens(sample=params.n, token_ids=[1])
            outs, reasons = [], []
            for i in range(params.n):
                ids = self.tokenizer.encode(self.reply(prompt, params, i))
                if self.append_eos:
                    ids = ids + [self.tokenizer.eos_token_id]
                reasons.append("length" if len(ids) > params.max_tokens else "stop")
                outs.append(ids[:params.max_tokens])
            pos = [0] * params.n
            events = 0
            while any(p <= len(o) for p, o in zip(pos, outs)):
                for i, o in enumerate(outs):
                    if pos[i] > len(o):
                        continue
                    if self.error is not None and events == self.error_after:
                        yield self.error
                        return
                    if self.hang_after is not None and events >= self.hang_after:
                        await asyncio.Event().wait()
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    if pos[i] == len(o):
                        pos[i] += 1
                        # the HTTP layer may close us at this last yield
                        rec["finished"] = all(p > len(o) for p, o in zip(pos, outs))
                        yield SampleDone(sample=i, reason=reasons[i])
                    else:
                        ids = o[pos[i]:pos[i] + self.chunk]
                        yield Tokens(sample=i, token_ids=ids,
                                     logprobs=fake_logprobs(ids, params) if params.logprobs
                                     else [])
                        pos[i] += self.chunk
                        pos[i] = min(pos[i], len(o))
                    events += 1
        except GeneratorExit:
            rec["closed"] = "aclose"
            raise
        except asyncio.CancelledError:
            rec["closed"] = "cancelled"
            raise


# ------------------------------------------------------------------ server
class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1, a free port, in a daemon thread."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not stop"
        self.sock.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def served(tokenizer):
    backend = FakeBackend(tokenizer)
    with ServerThread(create_app(backend)) as s:
        s.backend = backend
        yield s


@pytest.fixture
def fake(served):
    served.backend.reset()
    return served.backend


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        yield c


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def metrics(http) -> dict:
    """{(sample name, frozenset(labels)): value} of /metrics."""
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def m(snap, name, **labels) -> float:
    return snap.get((name, frozenset(labels.items())), 0.0)

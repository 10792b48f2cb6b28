"""The OpenAI-compatible HTTP layer of ``shmcache serve``: the app and its routes.

``create_app(backend)`` builds a FastAPI app over any object that behaves as
:class:`shmcache.server.api.Backend`:

    POST /v1/completions         prompt: a string or a list of token ids
    POST /v1/chat/completions    messages, through the tokenizer's chat template
    GET  /v1/models              the served model
    GET  /health                 200 {"status": "ok", "workers_alive": N}, 503 when N == 0
    GET  /metrics                Prometheus text

Guards, before a request reaches the backend: the body's size
(``max_body_bytes``, a 413), the API key (``api_key``: a 401 without
``Authorization: Bearer KEY``; ``/health`` stays open), CORS
(``allowed_origins``), and the prompt's length (longer than the model's
context or than ``max_prompt_tokens``: a 400). Decoding the body and
tokenizing the prompt run in worker threads, never on the event loop, so a
large prompt cannot stall ``/health`` or the other clients.

Every request is logged in one line (endpoint, status, tokens in/out, cached
tokens, time to first token, the reason for an error).

A request goes through these modules, in order:

    http_errors.py   the body read into a request model; OpenAI's error shape
    validation.py    checks against the backend (a 400, and the backend is not
                     called); token ids and :class:`SamplingParams`
    generation.py    ``backend.generate`` iterated; the request counted
    sample_text.py   each sample detokenized; stop strings matched
    responses.py     one JSON response, or a server-sent event stream
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Callable, Optional, Sequence

import hmac

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .api import Backend
from .generation import CLIENT_CLOSED, Generation  # noqa: F401  (re-exported)
from .http_errors import (DEFAULT_MAX_BODY_BYTES, APIError, error_body,  # noqa: F401
                          error_response, json_response, param_name, parse_body)
from .metrics import Metrics
from .openai_types import ChatCompletionRequest, CompletionRequest
from .responses import CHAT, COMPLETIONS, ChatShape, CompletionShape, respond
from .sample_text import SampleText
from .validation import (DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS,
                         RequestChecker)

log = logging.getLogger("shmcache.server")

# the names these had when this module held the whole HTTP layer
_Sample = SampleText
_Generation = Generation


class _Server(RequestChecker):
    """What the routes share: the request checks, the metrics, the EOS ids."""

    def __init__(self, backend: Backend, served_model_name: Optional[str],
                 default_chat_max_tokens: int, max_prompt_tokens: Optional[int] = None):
        super().__init__(backend, served_model_name, default_chat_max_tokens)
        self.eos_ids = frozenset(getattr(self.tokenizer, "eos_token_ids", None) or ())
        self.metrics = Metrics(backend.stats)
        self.created = int(time.time())
        self.max_prompt_tokens = max_prompt_tokens

    async def prompt_of(self, make, req, param: str) -> list[int]:
        """``make(req)`` (tokenization, a chat template) in a worker thread;
        a string the tokenizer cannot encode (a lone surrogate) is a 400."""
        try:
            return await anyio.to_thread.run_sync(make, req)
        except (UnicodeEncodeError, UnicodeDecodeError) as e:     # (they have .reason)
            raise APIError(f"Invalid value for '{param}': the text cannot be encoded as "
                           f"UTF-8 ({e.reason}; a lone surrogate such as \\ud800?).",
                           param=param) from None

    def check_prompt_length(self, n: int, param: str) -> None:
        """A prompt longer than the model's context or ``--max-prompt-tokens`` is a 400."""
        ctx = getattr(self.backend, "context_length", None)
        if ctx and n > ctx:
            raise APIError(f"Invalid value for '{param}': the prompt has {n} tokens, more "
                           f"than the model's context length of {ctx}.", param=param)
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise APIError(f"Invalid value for '{param}': the prompt has {n} tokens, more "
                           f"than this server's limit of {self.max_prompt_tokens} "
                           f"(--max-prompt-tokens).", param=param)

    def check_top_k(self, params) -> None:
        if params.top_k > self.vocab_size:
            raise APIError(f"Invalid value for 'top_k': {params.top_k} is more than the "
                           f"vocabulary size ({self.vocab_size}).", param="top_k")

    def log_request(self, endpoint: str, status: int, *, prompt_tokens=None,
                    completion_tokens=None, cached_tokens=None, ttft=None,
                    reason: Optional[str] = None) -> None:
        """The one log line of a request."""
        parts = [f"{endpoint} {status}"]
        if prompt_tokens is not None:
            parts.append(f"tokens in {prompt_tokens} (cached {cached_tokens or 0}) "
                         f"out {completion_tokens or 0}")
        if ttft is not None:
            parts.append(f"ttft {ttft * 1000:.0f} ms")
        if reason:
            parts.append(f"reason: {reason}")
        log.info("request %s", ", ".join(parts))

    async def generate(self, request: Request, shape, req, prompt: list[int],
                       params, t0: float) -> Response:
        """See :func:`shmcache.server.responses.respond`."""
        return await respond(self, request, shape, req, prompt, params, t0)


class _BackendLife:
    """Starts the backend once and closes it once (``close`` is also safe to
    call from ``main`` after uvicorn skipped the lifespan shutdown)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.started = self.closed = False

    async def start(self) -> None:
        try:
            await self.backend.start()
        except BaseException:
            await self.close()
            raise
        self.started = True

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.backend.close()


class _APIKey:
    """ASGI middleware: every HTTP request but ``/health`` (and a CORS
    preflight) must carry ``Authorization: Bearer <key>``; else a 401."""

    OPEN = ("/health",)

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["path"] in self.OPEN
                or scope["method"] == "OPTIONS"):
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        log.info("request %s %s 401, reason: %s", scope["method"], scope["path"],
                 "no API key" if not auth else "a wrong API key")
        resp = error_response(401, "Incorrect or missing API key: send the server's key "
                                   "as 'Authorization: Bearer KEY'.")
        resp.headers["WWW-Authenticate"] = "Bearer"
        await resp(scope, receive, send)


def create_app(backend: Backend, *, served_model_name: Optional[str] = None,
               manage_backend: bool = True,
               default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
               on_ready: Optional[Callable[[], None]] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_prompt_tokens: Optional[int] = None, api_key: Optional[str] = None,
               allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The app over ``backend``.

    Args:
        backend: the generation backend.
        served_model_name: the model name listed and echoed (default
            ``backend.model_id``; requests may name either).
        manage_backend: the app's lifespan awaits ``backend.start()`` at
            startup and ``backend.close()`` at shutdown
            (``app.state.backend_life`` closes it at most once).
        default_chat_max_tokens: a chat request's ``max_tokens`` when it
            gives none (lowered to what the pool can hold).
        on_ready: called once the backend has started.
        max_body_bytes: a larger request body is a 413.
        max_prompt_tokens: a longer prompt is a 400 (the model's context
            length, ``backend.context_length``, always applies).
        api_key: requests must carry ``Authorization: Bearer <api_key>``
            (else a 401); ``/health`` stays open.
        allowed_origins: CORS: browser origins allowed to call the API
            (``*``: any).

    Returns:
        The FastAPI app.
    """
    srv = _Server(backend, served_model_name, default_chat_max_tokens, max_prompt_tokens)
    life = _BackendLife(backend)

    @asynccontextmanager
    async def lifespan(app):
        cancelled = False
        if manage_backend:
            try:
                await life.start()
            except Exception as e:
                # a stop asked for during startup: the server starts and stops
                # at once (uvicorn has its exit flag set), without a traceback
                if not getattr(e, "startup_cancelled", False):
                    raise
                cancelled = True
                log.info("stopped while starting: %s", e)
        try:
            if on_ready is not None and not cancelled:
                on_ready()
            yield
        finally:
            if manage_backend:
                with anyio.CancelScope(shield=True):
                    await life.close()

    app = FastAPI(title="shmcache", summary="OpenAI-compatible server over a shared KV cache",
                  lifespan=lifespan)
    app.state.backend_life = life
    app.state.server = srv
    if api_key:
        app.add_middleware(_APIKey, key=api_key)
    if allowed_origins:                 # outermost: a preflight needs no key
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # 404 (no such route), 405 (wrong method): OpenAI's shape too
        msg = (f"No route {request.url.path}." if exc.status_code == 404 else
               f"Method {request.method} not allowed on {request.url.path}."
               if exc.status_code == 405 else str(exc.detail))
        srv.log_request(f"{request.method} {request.url.path}", exc.status_code, reason=msg)
        resp = error_response(exc.status_code, msg)
        for k, v in (getattr(exc, "headers", None) or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        param = param_name(tuple(errs[0].get("loc", ()))[1:]) if errs else None
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        srv.log_request(request.url.path, 400, reason=f"{param}: {msg}")
        return error_response(400, f"Invalid value for '{param}': {msg}", param)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Starlette re-raises it after this response, and uvicorn logs it.
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        t0 = time.monotonic()
        try:
            req = await parse_body(request, CompletionRequest, max_body_bytes)
            srv.check_common(req)
            prompt = await srv.prompt_of(srv.completion_prompt, req, "prompt")
            srv.check_prompt_length(len(prompt), "prompt")
            n = req.n or 1
            requested, param = req.max_new_tokens
            max_tokens = srv.length(len(prompt), n, requested, param,
                                    DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
            params = srv.sampling_params(req, max_tokens)
            srv.check_top_k(params)
        except APIError as e:
            srv.metrics.request(COMPLETIONS, e.status)
            srv.log_request(COMPLETIONS, e.status, reason=e.message)
            return e.response()
        return await srv.generate(request, CompletionShape, req, prompt, params, t0)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        t0 = time.monotonic()
        try:
            req = await parse_body(request, ChatCompletionRequest, max_body_bytes)
            srv.check_common(req)
            prompt = await srv.prompt_of(srv.chat_prompt, req, "messages")
            srv.check_prompt_length(len(prompt), "messages")
            requested, param = req.max_new_tokens
            max_tokens = srv.length(len(prompt), req.n or 1, requested, param,
                                    srv.default_chat_max_tokens, "messages")
            params = srv.sampling_params(req, max_tokens)
            srv.check_top_k(params)
        except APIError as e:
            srv.metrics.request(CHAT, e.status)
            srv.log_request(CHAT, e.status, reason=e.message)
            return e.response()
        return await srv.generate(request, ChatShape, req, prompt, params, t0)

    def _model_card() -> dict:
        return {"id": srv.model_name, "object": "model", "created": srv.created,
                "owned_by": "shmcache"}

    @app.get("/v1/models")
    async def models():
        srv.metrics.request("/v1/models", 200)
        return json_response({"object": "list", "data": [_model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in srv.accepted_models:
            srv.metrics.request("/v1/models/{model}", 404)
            return error_response(404, f"The model '{model_id}' does not exist.", "model")
        srv.metrics.request("/v1/models/{model}", 200)
        return json_response(_model_card())

    @app.get("/health")
    async def health():
        try:
            alive = int(backend.stats().get("workers_alive", 0))
        except Exception:
            log.exception("backend.stats() failed")
            alive = 0
        status = 200 if alive > 0 else 503
        srv.metrics.request("/health", status)
        return json_response({"status": "ok" if alive > 0 else "unavailable",
                              "workers_alive": alive}, status)

    @app.get("/metrics")
    async def metrics():
        srv.metrics.request("/metrics", 200)
        body, ctype = srv.metrics.render()
        return Response(body, media_type=ctype)

    return app

"""The OpenAI-compatible HTTP layer of ``shmcache serve``: the app and its routes.

``create_app(backend)`` builds a FastAPI app over any object that behaves as
:class:`shmcache.server.api.Backend`:

    POST /v1/completions         prompt: a string or a list of token ids
    POST /v1/chat/completions    messages, through the tokenizer's chat template
    GET  /v1/models              the served model
    GET  /health                 200 {"status": "ok", "workers_alive": N}, 503 when N == 0
    GET  /metrics                Prometheus text

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
from typing import Callable, Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from .api import Backend
from .generation import CLIENT_CLOSED, Generation  # noqa: F401  (re-exported)
from .http_errors import (APIError, error_body, error_response,  # noqa: F401  (re-exported)
                          json_response, param_name, parse_body)
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
                 default_chat_max_tokens: int):
        super().__init__(backend, served_model_name, default_chat_max_tokens)
        self.eos_ids = frozenset(getattr(self.tokenizer, "eos_token_ids", None) or ())
        self.metrics = Metrics(backend.stats)
        self.created = int(time.time())

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


def create_app(backend: Backend, *, served_model_name: Optional[str] = None,
               manage_backend: bool = True,
               default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
               on_ready: Optional[Callable[[], None]] = None) -> FastAPI:
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

    Returns:
        The FastAPI app.
    """
    srv = _Server(backend, served_model_name, default_chat_max_tokens)
    life = _BackendLife(backend)

    @asynccontextmanager
    async def lifespan(app):
        if manage_backend:
            await life.start()
        try:
            if on_ready is not None:
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

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        param = param_name(tuple(errs[0].get("loc", ()))[1:]) if errs else None
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return error_response(400, f"Invalid value for '{param}': {msg}", param)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Starlette re-raises it after this response, and uvicorn logs it.
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        t0 = time.monotonic()
        try:
            req = await parse_body(request, CompletionRequest)
            srv.check_common(req)
            prompt = srv.completion_prompt(req)
            requested, param = req.max_new_tokens
            max_tokens = srv.length(len(prompt), req.n or 1, requested, param,
                                    DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
            params = srv.sampling_params(req, max_tokens)
        except APIError as e:
            srv.metrics.request(COMPLETIONS, e.status)
            return e.response()
        return await srv.generate(request, CompletionShape, req, prompt, params, t0)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        t0 = time.monotonic()
        try:
            req = await parse_body(request, ChatCompletionRequest)
            srv.check_common(req)
            prompt = srv.chat_prompt(req)
            requested, param = req.max_new_tokens
            max_tokens = srv.length(len(prompt), req.n or 1, requested, param,
                                    srv.default_chat_max_tokens, "messages")
            params = srv.sampling_params(req, max_tokens)
        except APIError as e:
            srv.metrics.request(CHAT, e.status)
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

"""The OpenAI-compatible HTTP layer of ``shmcache serve``.

``create_app(backend)`` builds a FastAPI app over any object that behaves as
:class:`shmcache.server.api.Backend`:

    POST /v1/completions         prompt: a string or a list of token ids
    POST /v1/chat/completions    messages, through the tokenizer's chat template
    GET  /v1/models              the served model
    GET  /health                 200 {"status": "ok", "workers_alive": N}, 503 when N == 0
    GET  /metrics                Prometheus text

The app validates a request (every problem is an HTTP 400 in OpenAI's error
shape, and the backend is not called), turns it into token ids and a
:class:`SamplingParams`, and iterates ``backend.generate``. Each sample is
detokenized with its own streaming detokenizer, so a multi-byte character is
never split between chunks. Stop strings are matched here, on each sample's
text: the text ends before the stop string, and text that might be the start
of a stop string is held back while streaming until it is known not to be.
When every sample has finished, or the client disconnects, the backend's
generator is closed (which cancels the work).

Lengths: ``max_tokens`` (chat: ``max_completion_tokens`` first) that the pool
can never hold is a 400. When the client gives none, the default (16 for
completions as in OpenAI's API, ``default_chat_max_tokens`` for chat) is
lowered to what the pool can hold.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any, Awaitable, Callable, Optional

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from .api import Backend
from .metrics import Metrics
from .openai_types import ChatCompletionRequest, CompletionRequest
from .protocol import Error, SampleDone, SamplingParams, Started, Tokens

log = logging.getLogger("shmcache.server")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 512
CLIENT_CLOSED = 499                    # the status counted when the client went away first


# ----------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def response(self) -> Response:
        return error_response(self.status, self.message, self.param)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_response(status: int, message: str, param: Optional[str] = None) -> Response:
    return _json(error_body(status, message, param), status)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _param(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def _from_validation(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    param = _param(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err.get("type") == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param)
    return APIError(f"Invalid value for '{param}': {msg}", param=param)


async def _parse(request: Request, cls):
    body = await request.body()
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:          # JSONDecodeError, bad UTF-8
        raise APIError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise APIError("The request body must be a JSON object.")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise _from_validation(e) from None


# ------------------------------------------------------- one sample's text
class _Sample:
    """Detokenizes one sample and finds its stop strings.

    ``sent`` is how much of the detokenizer's text has been released; text
    after it that could still become a stop string is held back."""

    def __init__(self, tokenizer, stops: list[str], skip_ids: frozenset):
        self.detok = tokenizer.detokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.skip = skip_ids
        self.sent = 0
        self.checked = 0              # text length already searched for stop strings
        self.end: Optional[int] = None
        self.reason: Optional[str] = None
        self.tokens = 0

    @property
    def done(self) -> bool:
        return self.reason is not None

    def add(self, ids) -> str:
        """Feeds token ids; returns the text now safe to release. Sets
        ``reason = 'stop'`` when a stop string completed (later ids ignored)."""
        for t in ids:
            if self.reason is not None:
                break
            self.tokens += 1
            if t in self.skip:        # EOS / stop token, should the backend pass it on
                continue
            self.detok.add_token(t)
            if self.stops:
                self._find_stop()
        return self._release(final=False)

    def finish(self, reason: str) -> str:
        """The backend finished this sample; returns the rest of its text."""
        if self.reason is None:
            self.detok.finalize()
            if self.stops:
                self._find_stop()
            if self.reason is None:
                self.reason = reason
        return self._release(final=True)

    def _find_stop(self) -> None:
        text = self.detok.text
        if len(text) <= self.checked:
            return
        # A match must end in the new text, so it starts at most ``hold``
        # characters before it (and never in text already released).
        start = max(self.sent, self.checked - self.hold)
        self.checked = len(text)
        best = -1
        for s in self.stops:
            i = text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        if best != -1:
            self.end, self.reason = best, "stop"

    def _release(self, final: bool) -> str:
        text = self.detok.text
        if self.end is not None:
            upto = self.end
        elif final or not self.stops:
            upto = len(text)
        else:
            upto = len(text) - self._held(text)
        if upto <= self.sent:
            return ""
        out, self.sent = text[self.sent:upto], upto
        return out

    def _held(self, text: str) -> int:
        """The longest tail of the unreleased text that starts a stop string."""
        for k in range(min(self.hold, len(text) - self.sent), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


# -------------------------------------------------- one request's generation
class _Generation:
    """One request's run through the backend: the generator, the samples'
    text, the usage, and the metrics (counted once, by ``finish``)."""

    def __init__(self, srv: "_Server", endpoint: str, prompt: list[int],
                 params: SamplingParams, stops: list[str], t0: float):
        self.srv, self.endpoint, self.t0 = srv, endpoint, t0
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0
        skip = frozenset(srv.eos_ids) | frozenset(params.stop_token_ids)
        self.samples = [_Sample(srv.tokenizer, stops, skip) for _ in range(params.n)]
        self.status: Optional[int] = None       # the outcome, for the requests counter
        self._pending = None
        self._first_token_seen = False
        self._closed = self._finished = False
        self._gen = srv.backend.generate(prompt, params)
        srv.metrics.running.inc()

    # the backend's events
    async def _next(self):
        """The next event; StopAsyncIteration at the end; an Error for a
        backend that raised."""
        try:
            return await self._gen.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as e:
            log.exception("backend.generate failed")
            return Error(f"internal error in the backend: {type(e).__name__}: {e}", 500)

    async def start(self) -> Optional[Error]:
        """Waits until the backend admitted the request (``Started``)."""
        try:
            ev = await self._next()
        except StopAsyncIteration:
            return Error("the backend ended the request before starting it", 500)
        if isinstance(ev, Error):
            return ev
        if not isinstance(ev, Started):         # lenient: no Started, go on
            self._pending = ev
            ev = Started(prompt_tokens=self.prompt_tokens, cached_tokens=0, worker=-1)
        self.cached_tokens = ev.cached_tokens
        self.srv.metrics.admitted(ev.prompt_tokens, ev.cached_tokens)
        return None

    async def updates(self):
        """Yields ``(sample, text, finish_reason or None)``, or one ``Error``
        (last); the backend's generator is closed when this ends."""
        try:
            while not all(s.done for s in self.samples):
                if self._pending is not None:
                    ev, self._pending = self._pending, None
                else:
                    try:
                        ev = await self._next()
                    except StopAsyncIteration:
                        yield Error("the backend ended the request before finishing it", 500)
                        return
                if isinstance(ev, Error):
                    yield ev
                    return
                try:
                    upd = self._apply(ev)
                except Exception as e:          # a bad event (sample out of range, ...)
                    log.exception("cannot handle the backend's event %r", ev)
                    yield Error(f"internal error handling the backend's output: "
                                f"{type(e).__name__}: {e}", 500)
                    return
                if upd is not None:
                    yield upd
        finally:
            with anyio.CancelScope(shield=True):
                await self.aclose()

    def _apply(self, ev):
        if isinstance(ev, Tokens):
            if ev.sample < 0:
                raise IndexError(f"sample {ev.sample}")
            s = self.samples[ev.sample]
            if ev.token_ids and not self._first_token_seen:
                self._first_token_seen = True
                self.srv.metrics.ttft.observe(time.monotonic() - self.t0)
            self.srv.metrics.generation_tokens.inc(len(ev.token_ids))
            if s.done:
                return None
            text = s.add(ev.token_ids)
            if s.done:
                return ev.sample, text, s.reason
            return (ev.sample, text, None) if text else None
        if isinstance(ev, SampleDone):
            if ev.sample < 0:
                raise IndexError(f"sample {ev.sample}")
            s = self.samples[ev.sample]
            if s.done:
                return None
            text = s.finish("length" if ev.reason == "length" else "stop")
            return ev.sample, text, s.reason
        return None                             # a repeated Started: nothing to say

    def usage(self) -> dict:
        done = sum(s.tokens for s in self.samples)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self._gen, "aclose", None)
        if close is None:                       # a plain async iterator
            return
        try:
            await close()
        except Exception:
            log.exception("closing the backend's generator failed")

    def finish(self, status: Optional[int] = None) -> None:
        if self._finished:
            return
        self._finished = True
        self.srv.metrics.running.dec()
        self.srv.metrics.request(self.endpoint, status or self.status or CLIENT_CLOSED)


async def _unless_disconnected(request: Request, fn: Callable[[], Awaitable[Any]]):
    """``(True, await fn())``, or ``(False, None)`` when the client
    disconnects first (``fn`` is then cancelled)."""
    box = []
    async with anyio.create_task_group() as tg:
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()
        tg.start_soon(watch)
        box.append(await fn())
        tg.cancel_scope.cancel()
    return (True, box[0]) if box else (False, None)


class _SSEResponse(StreamingResponse):
    """A stream that closes its generation however the response ends."""

    def __init__(self, gen: _Generation, body):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generation = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._generation.aclose()
            self._generation.finish()


# ------------------------------------------------------- response shapes
class _CompletionShape:
    endpoint, object, chunk_object, id_prefix = (COMPLETIONS, "text_completion",
                                                 "text_completion", "cmpl-")
    first_delta = False

    @staticmethod
    def choice(i, text, reason):
        return {"index": i, "text": text, "logprobs": None, "finish_reason": reason}

    chunk_choice = choice


class _ChatShape:
    endpoint, object, chunk_object, id_prefix = (CHAT, "chat.completion",
                                                 "chat.completion.chunk", "chatcmpl-")
    first_delta = True

    @staticmethod
    def choice(i, text, reason):
        return {"index": i, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": reason}

    @staticmethod
    def chunk_choice(i, text, reason, role=False):
        delta = {"role": "assistant", "content": text} if role else (
            {"content": text} if text else {})
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


# ------------------------------------------------------------------ server
class _Server:
    def __init__(self, backend: Backend, served_model_name: Optional[str],
                 default_chat_max_tokens: int):
        self.backend = backend
        self.model_name = served_model_name or backend.model_id
        self.accepted_models = {self.model_name, backend.model_id}
        self.tokenizer = backend.tokenizer
        self.vocab_size = int(getattr(backend, "vocab_size", None) or len(self.tokenizer))
        self.eos_ids = frozenset(getattr(self.tokenizer, "eos_token_ids", None) or ())
        self.default_chat_max_tokens = default_chat_max_tokens
        self.metrics = Metrics(backend.stats)
        self.created = int(time.time())

    # ------------------------------------------------------ validation
    def check_common(self, req) -> None:
        if req.model is not None and req.model not in self.accepted_models:
            raise APIError(f"The model '{req.model}' does not exist; this server serves "
                           f"'{self.model_name}'.", param="model")
        bad = req.unsupported()
        if bad is not None:
            raise APIError(bad[1], param=bad[0])
        n = req.n or 1
        if n > self.backend.max_n:
            raise APIError(f"Invalid value for 'n': {n} is more than this server's maximum "
                           f"of {self.backend.max_n}.", param="n")
        self.check_ids(req.stop_token_ids or [], "stop_token_ids")

    def check_ids(self, ids: list[int], param: str) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise APIError(f"Invalid value for '{param}': token id {t} (at index {i}) is "
                               f"outside the vocabulary [0, {self.vocab_size}).", param=param)

    def length(self, prompt_len: int, n: int, requested: Optional[int], param: str,
               default: int, prompt_param: str) -> int:
        adm = self.backend.admission_error
        if requested is not None:
            why = adm(prompt_len, requested, n)
            if why is not None:
                raise APIError(why, param=self._blame(prompt_len, n, requested, param,
                                                      prompt_param))
            return requested
        if adm(prompt_len, default, n) is None:
            return default
        why = adm(prompt_len, 1, n)
        if why is not None:
            raise APIError(why, param=self._blame(prompt_len, n, 1, param, prompt_param))
        lo, hi = 1, default - 1                 # lo fits; find the largest that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if adm(prompt_len, mid, n) is None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _blame(self, prompt_len, n, max_tokens, param, prompt_param) -> str:
        """The parameter to name when the pool can never hold a request."""
        adm = self.backend.admission_error
        if adm(prompt_len, 1, 1) is not None:
            return prompt_param
        if n > 1 and adm(prompt_len, max_tokens, 1) is None:
            return "n"
        return param

    def sampling_params(self, req, max_tokens: int) -> SamplingParams:
        top_k = req.top_k or 0
        return SamplingParams(
            max_tokens=max_tokens, n=req.n or 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k < 0 else top_k,
            min_p=req.min_p or 0.0, seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []), salt=req.cache_salt)

    # ------------------------------------------------------ endpoints
    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise APIError("Invalid value for 'prompt': the prompt is empty.", param="prompt")
            ids = list(self.tokenizer.encode(req.prompt))
        else:
            ids = list(req.prompt)
            self.check_ids(ids, "prompt")
        if not ids:
            raise APIError("Invalid value for 'prompt': the prompt is empty.", param="prompt")
        return ids

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise APIError("Invalid value for 'messages': the list is empty.", param="messages")
        try:
            out = self.tokenizer.apply_chat_template(
                [m.to_template() for m in req.messages], add_generation_prompt=True)
        except Exception as e:                  # jinja errors: roles out of order, ...
            raise APIError(f"Invalid value for 'messages': the chat template failed: {e}",
                           param="messages") from None
        ids = list(out["input_ids"] if isinstance(out, Mapping) else out)
        if not ids:
            raise APIError("Invalid value for 'messages': the prompt is empty.",
                           param="messages")
        return ids

    async def generate(self, request: Request, shape, req, prompt: list[int],
                       params: SamplingParams, t0: float) -> Response:
        gen = _Generation(self, shape.endpoint, prompt, params, req.stop or [], t0)
        streaming = False
        try:
            ok, err = await _unless_disconnected(request, gen.start)
            if not ok:
                return Response(status_code=CLIENT_CLOSED)
            if err is not None:
                gen.status = err.status
                return error_response(err.status, err.message)
            rid = shape.id_prefix + uuid.uuid4().hex
            created = int(time.time())
            if req.stream:
                streaming = True
                return _SSEResponse(gen, self._stream(gen, shape, rid, created,
                                                      req.include_usage))
            ok, result = await _unless_disconnected(request, lambda: self._collect(gen))
            if not ok:
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(result, Error):
                gen.status = result.status
                return error_response(result.status, result.message)
            gen.status = 200
            return _json({
                "id": rid, "object": shape.object, "created": created, "model": self.model_name,
                "choices": [shape.choice(i, "".join(parts), gen.samples[i].reason)
                            for i, parts in enumerate(result)],
                "usage": gen.usage()})
        finally:
            if not streaming:                   # a stream closes in _SSEResponse
                with anyio.CancelScope(shield=True):
                    await gen.aclose()
                gen.finish()

    async def _collect(self, gen: _Generation):
        parts: list[list[str]] = [[] for _ in gen.samples]
        async with aclosing(gen.updates()) as ups:
            async for u in ups:
                if isinstance(u, Error):
                    return u
                i, text, _ = u
                if text:
                    parts[i].append(text)
        return parts

    async def _stream(self, gen: _Generation, shape, rid: str, created: int,
                      include_usage: bool):
        base = {"id": rid, "object": shape.chunk_object, "created": created,
                "model": self.model_name}
        tail = {"usage": None} if include_usage else {}
        if shape.first_delta:
            yield _sse({**base, "choices": [shape.chunk_choice(i, "", None, role=True)
                                            for i in range(len(gen.samples))], **tail})
        async with aclosing(gen.updates()) as ups:
            async for u in ups:
                if isinstance(u, Error):
                    gen.status = u.status
                    yield _sse(error_body(u.status, u.message))
                    yield b"data: [DONE]\n\n"
                    return
                i, text, reason = u
                yield _sse({**base, "choices": [shape.chunk_choice(i, text, reason)], **tail})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": gen.usage()})
        gen.status = 200
        yield b"data: [DONE]\n\n"


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

    ``served_model_name``: the model name listed and echoed (default
    ``backend.model_id``; requests may name either). ``manage_backend``: the
    app's lifespan awaits ``backend.start()`` at startup and
    ``backend.close()`` at shutdown (``app.state.backend_life`` closes it at
    most once). ``on_ready`` is called once the backend has started.
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
        param = _param(tuple(errs[0].get("loc", ()))[1:]) if errs else None
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
            req = await _parse(request, CompletionRequest)
            srv.check_common(req)
            prompt = srv.completion_prompt(req)
            n = req.n or 1
            max_tokens = srv.length(len(prompt), n, req.max_tokens, "max_tokens",
                                    DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
            params = srv.sampling_params(req, max_tokens)
        except APIError as e:
            srv.metrics.request(COMPLETIONS, e.status)
            return e.response()
        return await srv.generate(request, _CompletionShape, req, prompt, params, t0)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        t0 = time.monotonic()
        try:
            req = await _parse(request, ChatCompletionRequest)
            srv.check_common(req)
            prompt = srv.chat_prompt(req)
            requested, param = req.max_new_tokens
            max_tokens = srv.length(len(prompt), req.n or 1, requested, param,
                                    srv.default_chat_max_tokens, "messages")
            params = srv.sampling_params(req, max_tokens)
        except APIError as e:
            srv.metrics.request(CHAT, e.status)
            return e.response()
        return await srv.generate(request, _ChatShape, req, prompt, params, t0)

    def _model_card() -> dict:
        return {"id": srv.model_name, "object": "model", "created": srv.created,
                "owned_by": "shmcache"}

    @app.get("/v1/models")
    async def models():
        srv.metrics.request("/v1/models", 200)
        return _json({"object": "list", "data": [_model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in srv.accepted_models:
            srv.metrics.request("/v1/models/{model}", 404)
            return error_response(404, f"The model '{model_id}' does not exist.", "model")
        srv.metrics.request("/v1/models/{model}", 200)
        return _json(_model_card())

    @app.get("/health")
    async def health():
        try:
            alive = int(backend.stats().get("workers_alive", 0))
        except Exception:
            log.exception("backend.stats() failed")
            alive = 0
        status = 200 if alive > 0 else 503
        srv.metrics.request("/health", status)
        return _json({"status": "ok" if alive > 0 else "unavailable", "workers_alive": alive},
                     status)

    @app.get("/metrics")
    async def metrics():
        srv.metrics.request("/metrics", 200)
        body, ctype = srv.metrics.render()
        return Response(body, media_type=ctype)

    return app

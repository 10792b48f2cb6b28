"""Writing a generation out: one JSON response, or a server-sent event stream.

:func:`respond` runs a :class:`~shmcache.server.generation.Generation` to
its end and answers in the shape of its endpoint (:class:`CompletionShape`
or :class:`ChatShape`): the whole text at once, or, with ``stream``, one
``data:`` event per piece of text and ``data: [DONE]`` last. A client that
disconnects cancels the generation (the request is counted as 499). A
stream not admitted within ``KEEPALIVE_S`` (a long prefill, a full server)
starts at once and sends ``: keep-alive`` comments until its first token,
so that clients and proxies do not time out.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
import msgspec
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from .generation import CLIENT_CLOSED, Generation
from .http_errors import error_body, error_response, json_response
from workers.protocol import Error, SamplingParams
from .tool_calls import ToolCallSplitter

if TYPE_CHECKING:
    from .app import _Server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


# ------------------------------------------------------- response shapes
def _token_text(tokenizer, t: int) -> str:
    return tokenizer.decode([t])


class CompletionShape:
    """``/v1/completions``: ``text_completion`` objects, ``choices[i].text``;
    ``logprobs`` as OpenAI's legacy object (``tokens``, ``token_logprobs``,
    ``top_logprobs``, ``text_offset``)."""

    endpoint, object, chunk_object, id_prefix = (COMPLETIONS, "text_completion",
                                                 "text_completion", "cmpl-")
    first_delta = False

    @staticmethod
    def choice(i, text, reason, logprobs=None, tool_calls=None):
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}

    chunk_choice = choice

    @staticmethod
    def logprobs(tokenizer, entries, offset: int) -> dict:
        """``entries``: (token id, TokenLogprob); ``offset``: the text's length
        before the first of them."""
        toks, lps, tops, offs = [], [], [], []
        for t, lp in entries:
            s = _token_text(tokenizer, t)
            toks.append(s)
            lps.append(lp.logprob)
            tops.append({_token_text(tokenizer, a): v for a, v in lp.top})
            offs.append(offset)
            offset += len(s)
        return {"tokens": toks, "token_logprobs": lps,
                "top_logprobs": tops if any(lp.top for _, lp in entries) else None,
                "text_offset": offs}


class ChatShape:
    """``/v1/chat/completions``: ``message`` choices, ``delta`` chunks that
    open with the assistant's role; ``logprobs`` as ``{"content": [{token,
    logprob, bytes, top_logprobs}]}``; ``tool_calls`` in the message (delta)."""

    endpoint, object, chunk_object, id_prefix = (CHAT, "chat.completion",
                                                 "chat.completion.chunk", "chatcmpl-")
    first_delta = True

    @staticmethod
    def choice(i, text, reason, logprobs=None, tool_calls=None):
        msg = {"role": "assistant", "content": text}
        if tool_calls:
            msg["content"] = text or None
            msg["tool_calls"] = tool_calls
        return {"index": i, "message": msg, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def chunk_choice(i, text, reason, logprobs=None, tool_calls=None, role=False):
        delta = {"role": "assistant", "content": text} if role else (
            {"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def logprobs(tokenizer, entries, offset: int) -> dict:
        def one(t, v):
            s = _token_text(tokenizer, t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}
        return {"content": [{**one(t, lp.logprob),
                             "top_logprobs": [one(a, v) for a, v in lp.top]}
                            for t, lp in entries]}


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


# ------------------------------------------------------- the connection
async def unless_disconnected(request: Request, fn: Callable[[], Awaitable[Any]]):
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


class SSEResponse(StreamingResponse):
    """A stream that closes its generation however the response ends."""

    def __init__(self, gen: Generation, body):
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


# ------------------------------------------------------- one request
async def respond(srv: "_Server", request: Request, shape, req, prompt: list[int],
                  params: SamplingParams, t0: float) -> Response:
    """Generates for a validated request and answers it.

    Args:
        srv: the app's server state.
        request: the HTTP request (watched for a disconnect).
        shape: :class:`CompletionShape` or :class:`ChatShape`.
        req: the validated request body (``stop``, ``stream``, ``include_usage``).
        prompt: the prompt's token ids.
        params: the sampling parameters.
        t0: ``time.monotonic()`` when the request arrived.

    Returns:
        The JSON response, the event stream, an error response, or an empty
        499 when the client went away.
    """
    gen = Generation(srv, shape.endpoint, prompt, params, req.stop or [], t0)
    streaming = False
    try:
        if req.stream:
            # not admitted within KEEPALIVE_S (a long prefill, a queue): the
            # stream starts now and sends SSE comments until the first token
            start = asyncio.ensure_future(gen.start())
            await asyncio.wait([start], timeout=KEEPALIVE_S)
            if not start.done():
                streaming = True
                rid = shape.id_prefix + uuid.uuid4().hex
                return SSEResponse(gen, _keepalive_then_stream(
                    srv, gen, start, shape, rid, int(time.time()), req.include_usage))
            start_result = start.result()

            async def started():
                return start_result
            ok, err = await unless_disconnected(request, started)
        else:
            ok, err = await unless_disconnected(request, gen.start)
        if not ok:
            return Response(status_code=CLIENT_CLOSED)
        if err is not None:
            gen.status = err.status
            return error_response(err.status, err.message)
        rid = shape.id_prefix + uuid.uuid4().hex
        created = int(time.time())
        splitters = _splitters(srv, shape, req, len(gen.samples), bool(req.stream))
        if req.stream:
            streaming = True
            return SSEResponse(gen, _stream(srv, gen, shape, rid, created, req.include_usage,
                                            splitters))
        ok, result = await unless_disconnected(request, lambda: _collect(gen))
        if not ok:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(result, Error):
            gen.status = result.status
            return error_response(result.status, result.message)
        gen.status = 200
        choices = []
        for i, (parts, lps) in enumerate(result):
            text, reason, calls = "".join(parts), gen.samples[i].reason, None
            if splitters is not None:
                text, calls = splitters[i].feed(text, final=True)
                if calls and reason == "stop":
                    reason = "tool_calls"
            logprobs = shape.logprobs(srv.tokenizer, lps, 0) if gen.params.logprobs else None
            choices.append(shape.choice(i, text, reason, logprobs, calls))
        return json_response({
            "id": rid, "object": shape.object, "created": created, "model": srv.model_name,
            "choices": choices, "usage": gen.usage()})
    finally:
        if not streaming:                   # a stream closes in SSEResponse
            with anyio.CancelScope(shield=True):
                await gen.aclose()
            gen.finish()


def _splitters(srv, shape, req, n: int, streaming: bool):
    """One tool-call splitter per sample when the chat request has tools, else None."""
    if shape is not ChatShape or not getattr(req, "tools", None):
        return None
    tools = [t.to_template() for t in req.tools]
    return [ToolCallSplitter(srv.tokenizer, tools, streaming) for _ in range(n)]


KEEPALIVE_S = 2.0                   # a stream's SSE comment interval before its first token


async def _keepalive_then_stream(srv, gen: Generation, start: "asyncio.Future", shape,
                                 rid: str, created: int, include_usage: bool):
    """``: keep-alive`` comments every KEEPALIVE_S until ``start`` (the
    generation's ``start``) is done, then the stream (or its error as an
    event). Ended early (a disconnect), it cancels ``start`` first, so that
    the backend's generator is not running when it is closed."""
    try:
        while not start.done():
            await asyncio.wait([start], timeout=KEEPALIVE_S)
            if not start.done():
                yield b": keep-alive\n\n"
    finally:
        if not start.done():
            start.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([start])
    err = start.result()
    if err is not None:
        gen.status = err.status
        yield sse(error_body(err.status, err.message))
        yield b"data: [DONE]\n\n"
        return
    async for chunk in _stream(srv, gen, shape, rid, created, include_usage):
        yield chunk


async def _collect(gen: Generation):
    """Each sample's (text parts, logprob entries), or an Error."""
    out: list = [([], []) for _ in gen.samples]
    async with aclosing(gen.updates()) as ups:
        async for u in ups:
            if isinstance(u, Error):
                return u
            i, text, _, lps = u
            if text:
                out[i][0].append(text)
            out[i][1].extend(lps)
    return out


async def _stream(srv: "_Server", gen: Generation, shape, rid: str, created: int,
                  include_usage: bool, splitters=None):
    base = {"id": rid, "object": shape.chunk_object, "created": created,
            "model": srv.model_name}
    tail = {"usage": None} if include_usage else {}
    offsets = [0] * len(gen.samples)            # text sent per sample (completions' text_offset)
    made_calls = [False] * len(gen.samples)
    if shape.first_delta:
        yield sse({**base, "choices": [shape.chunk_choice(i, "", None, role=True)
                                       for i in range(len(gen.samples))], **tail})
    async with aclosing(gen.updates()) as ups:
        async for u in ups:
            if isinstance(u, Error):
                gen.status = u.status
                yield sse(error_body(u.status, u.message))
                yield b"data: [DONE]\n\n"
                return
            i, text, reason, lps = u
            calls = None
            if splitters is not None:
                text, calls = splitters[i].feed(text, final=reason is not None)
                made_calls[i] = made_calls[i] or bool(calls)
                if reason == "stop" and made_calls[i]:
                    reason = "tool_calls"
                if not (text or calls or lps or reason):
                    continue
            logprobs = shape.logprobs(srv.tokenizer, lps, offsets[i]) if lps else None
            offsets[i] += len(text)
            yield sse({**base, "choices": [shape.chunk_choice(i, text, reason, logprobs, calls)],
                       **tail})
    if include_usage:
        yield sse({**base, "choices": [], "usage": gen.usage()})
    gen.status = 200
    yield b"data: [DONE]\n\n"

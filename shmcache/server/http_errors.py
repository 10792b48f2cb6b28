"""Errors in OpenAI's shape, and reading a request body into a request model.

Every problem with a request is an :class:`APIError` (an HTTP 400 unless it
says otherwise); its response body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``.

A body is read up to a limit (``max_body_bytes``; more is a 413, read no
further), then decoded and validated in a worker thread, so that a large
body never holds up the event loop (``/health`` and every other request).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import anyio
import msgspec
from fastapi import Request
from pydantic import ValidationError
from starlette.responses import Response


class APIError(Exception):
    """A request the server refuses, with the parameter at fault.

    Args:
        message: the sentence the client reads.
        param: the request parameter named in the body (``messages[0].content``).
        status: the HTTP status (400 unless given).
    """

    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def response(self) -> Response:
        """The error as an HTTP response."""
        return error_response(self.status, self.message, self.param)


DEFAULT_MAX_BODY_BYTES = 8 << 20     # a request body's limit (``--max-body-bytes``)

# the ``code`` OpenAI's clients see for these statuses
CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
         413: "request_too_large"}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """OpenAI's error object: ``invalid_request_error`` for a 4xx, else ``server_error``."""
    kind = ("authentication_error" if status == 401 else
            "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": CODES.get(status)}}


def error_response(status: int, message: str, param: Optional[str] = None) -> Response:
    """:func:`error_body` as a JSON response with ``status``."""
    return json_response(error_body(status, message, param), status)


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` as a JSON response (encoded by msgspec)."""
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def param_name(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def from_validation(e: ValidationError) -> APIError:
    """The first of pydantic's errors, worded as OpenAI words a 400."""
    err = e.errors(include_url=False)[0]
    param = param_name(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err.get("type") == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param)
    if err.get("type") == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param)
    return APIError(f"Invalid value for '{param}': {msg}", param=param)


async def read_body(request: Request, limit: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The request's body, read no further than ``limit`` bytes.

    Raises:
        APIError: a 413 when the body (or its Content-Length) exceeds ``limit``.
    """
    def too_large(n: str) -> APIError:
        return APIError(f"The request body ({n}) is larger than this server's limit of "
                        f"{limit} bytes (--max-body-bytes).", status=413)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared)} bytes")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def parse_body(request: Request, cls, limit: int = DEFAULT_MAX_BODY_BYTES):
    """The request's JSON body validated as ``cls`` (a pydantic model); the
    decoding runs in a worker thread.

    Raises:
        APIError: the body is too large (413), not JSON, not an object, or
            not a valid ``cls``.
    """
    body = await read_body(request, limit)
    return await anyio.to_thread.run_sync(decode_body, body, cls)


def _unencodable(obj, loc: tuple) -> Optional[tuple]:
    """The location of the first string in ``obj`` that UTF-8 cannot encode
    (JSON's ``\\ud800`` escapes decode to lone surrogates), or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return loc
        return None
    items = obj.items() if isinstance(obj, dict) else (
        enumerate(obj) if isinstance(obj, list) else ())
    for k, v in items:
        if isinstance(k, str) and _unencodable(k, ()) is not None:
            return loc
        found = _unencodable(v, loc + (k,))
        if found is not None:
            return found
    return None


def decode_body(body: bytes, cls):
    """``body`` as JSON validated as ``cls`` (see :func:`parse_body`)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:          # JSONDecodeError, bad UTF-8
        raise APIError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise APIError("The request body must be a JSON object.")
    bad = _unencodable(obj, ())
    if bad is not None:
        param = param_name(bad)
        raise APIError(f"Invalid value for '{param}': the text has a lone UTF-16 surrogate "
                       f"(such as \\ud800), which is not a character.", param=param)
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None

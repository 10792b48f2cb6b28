"""Errors in OpenAI's shape, and reading a request body into a request model.

Every problem with a request is an :class:`APIError` (an HTTP 400 unless it
says otherwise); its response body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

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


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """OpenAI's error object: ``invalid_request_error`` for a 4xx, else ``server_error``."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


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


async def parse_body(request: Request, cls):
    """The request's JSON body validated as ``cls`` (a pydantic model).

    Raises:
        APIError: the body is not JSON, not an object, or not a valid ``cls``.
    """
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
        raise from_validation(e) from None

"""Tool calls out of one sample's text, with the model's own markers and parser.

mlx-lm's tokenizer (``TokenizerWrapper``) knows, for the chat templates it
recognises, the text that opens and closes a tool call
(``tool_call_start``/``tool_call_end``, e.g. ``<tool_call>`` ...
``</tool_call>``) and the function that turns the text between them into
``{"name", "arguments"}`` (``tool_parser``, from ``mlx_lm.tool_parsers``).
:class:`ToolCallSplitter` feeds a sample's text through them as it streams:
text outside the markers is content, each complete call becomes an OpenAI
``tool_calls`` item. Text that may be the start of an opening marker is held
back until it is known not to be. A call that does not parse stays in the
content as the model wrote it (markers included): nothing is lost.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Optional

log = logging.getLogger("shmcache.server")


def _partial_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that starts ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallSplitter:
    """Splits one sample's text into content and tool calls.

    Args:
        tokenizer: an mlx-lm ``TokenizerWrapper`` with ``has_tool_calling``.
        tools: the request's tools (as given to the chat template), passed to
            the parser (some parsers type the arguments by them).
        streaming: number the calls (``index``), as stream chunks carry them.
    """

    def __init__(self, tokenizer, tools: Optional[list], streaming: bool = False) -> None:
        self.start: str = tokenizer.tool_call_start
        self.end: str = tokenizer.tool_call_end or ""
        self.parse = tokenizer.tool_parser
        self.tools = tools
        self.streaming = streaming
        self.calls = 0                  # tool calls returned so far
        self._buf = ""
        self._inside = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """Adds text; returns (content now safe to release, complete tool calls).
        ``final``: the sample ended; everything held back is released (an
        unclosed call is parsed if it can be)."""
        self._buf += text
        out: list[str] = []
        calls: list[dict] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.start)
                if i == -1:
                    keep = 0 if final else _partial_prefix(self._buf, self.start)
                    cut = len(self._buf) - keep
                    out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(self.start):]
                self._inside = True
            else:
                j = self._buf.find(self.end) if self.end else -1
                if j == -1:
                    if final:
                        self._take(self._buf, self.start + self._buf, out, calls)
                        self._buf, self._inside = "", False
                    break
                body = self._buf[:j]
                self._take(body, self.start + body + self.end, out, calls)
                self._buf = self._buf[j + len(self.end):]
                self._inside = False
        return "".join(out), calls

    def _take(self, body: str, raw: str, out: list, calls: list) -> None:
        try:
            parsed = self.parse(body, self.tools)
        except Exception as e:              # the model wrote something else: keep it as text
            log.warning("a tool call did not parse (%s: %s); returned as content",
                        type(e).__name__, e)
            out.append(raw)
            return
        for tc in parsed if isinstance(parsed, list) else [parsed]:
            calls.append(self._format(tc))

    def _format(self, tc: dict) -> dict:
        args: Any = tc.get("arguments", {})
        out = {"id": tc.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": tc["name"],
                            "arguments": args if isinstance(args, str)
                            else json.dumps(args, ensure_ascii=False)}}
        if self.streaming:
            out["index"] = self.calls
        self.calls += 1
        return out

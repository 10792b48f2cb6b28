"""Request bodies of the OpenAI endpoints ``shmcache serve`` implements.

Validation is strict (no coercion: ``"max_tokens": "5"`` or ``1.5`` is an
error, NaN and infinities are refused). Every field is either honoured or
refused with a 400 that names it: a field this server does not know at all
is refused ("Unrecognized request argument supplied"; mlx_lm.server ignores
those, but a client that sends one expects it to matter), and a known field
set to something this server does not implement is refused by
:meth:`unsupported`. Only inside a message are unknown keys ignored (clients
echo back assistant messages with keys such as ``refusal``). The README's
table of request fields lists each one; ``tests/test_server_fields.py``
checks it field by field.
Checks that need the backend (the model name, ``n`` against ``max_n``, token
ids against the vocabulary, what the pool can hold) are in ``validation.py``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MAX_INT32 = 2**31 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _check_prompt(v: Any) -> Any:
    """A string or a list of token ids; a batch of exactly one of these is
    unwrapped (some clients always send a list)."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if all(type(x) is int for x in v):
            return v
        if v and all(isinstance(x, (str, list)) for x in v):
            raise ValueError("batched prompts are not supported: send one prompt per request")
    raise ValueError("must be a string or a list of token ids (integers)")


def _check_stop(v: Any) -> Any:
    """A string or a list of strings; empty strings are dropped."""
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise ValueError("must be a string or a list of strings")


def _check_content(v: Any) -> Any:
    """A string, null, or a list of text parts (joined into one string)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for p in v:
            if not (isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)):
                raise ValueError("only text content is supported: a string or a list of "
                                 "{\"type\": \"text\", \"text\": ...} parts")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError("must be a string or a list of text parts")


Prompt = Annotated[Union[str, list[int]], BeforeValidator(_check_prompt)]
Stop = Annotated[Optional[list[str]], BeforeValidator(_check_stop)]
Content = Annotated[Optional[str], BeforeValidator(_check_content)]


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None


#: the chat-template arguments the server sets itself (``chat_template_kwargs`` may not)
RESERVED_TEMPLATE_KWARGS = frozenset((
    "add_generation_prompt", "continue_final_message", "tokenize", "tools", "documents",
    "conversation", "messages", "chat_template", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs"))

#: fields mlx_lm.server (or OpenAI) knows that this server refuses whenever set
_REFUSED = {
    "adapters": "LoRA adapters are not supported (serve a fused model)",
    "draft_model": "speculative decoding is not supported",
    "num_draft_tokens": "speculative decoding is not supported",
    "reasoning_effort": "this server has no reasoning-effort control",
    "timeout": "a request timeout is not supported (close the connection to cancel)",
    "role_mapping": "role_mapping is not supported (the model's chat template is used)",
}


class _Common(_Strict):
    """The fields completions and chat completions share."""
    model: Optional[str] = None
    n: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Stop = None
    stop_token_ids: Optional[list[int]] = None          # vLLM's extension
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_INT32)   # 0 and -1: off
    min_p: Optional[float] = Field(None, ge=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32)
    cache_salt: Optional[str] = Field(None, min_length=1)     # the tenant's prefix-cache salt
    user: Any = None                                          # accepted; no effect on the output
    # mlx-lm's logits processors and XTC (mlx_lm.server's fields and defaults)
    repetition_penalty: Optional[float] = Field(None, ge=0)
    repetition_context_size: Optional[int] = Field(None, ge=0, le=MAX_INT32)
    presence_penalty: Optional[float] = Field(None, ge=-2**20, le=2**20)
    presence_context_size: Optional[int] = Field(None, ge=0, le=MAX_INT32)
    frequency_penalty: Optional[float] = Field(None, ge=-2**20, le=2**20)
    frequency_context_size: Optional[int] = Field(None, ge=0, le=MAX_INT32)
    logit_bias: Optional[dict[str, float]] = None
    xtc_probability: Optional[float] = Field(None, ge=0, le=1)
    xtc_threshold: Optional[float] = Field(None, ge=0, le=0.5)
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    # known, and refused whenever set (see _REFUSED)
    adapters: Any = None
    draft_model: Any = None
    num_draft_tokens: Any = None
    reasoning_effort: Any = None
    timeout: Any = None
    role_mapping: Any = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for a parameter set to something this server does
        not implement (or, for ``stream_options``, not without ``stream``), or None."""
        for name, why in _REFUSED.items():
            if getattr(self, name) is not None:
                return name, f"'{name}' is not supported: {why}"
        if self.stream_options is not None and not self.stream:
            # (OpenAI and vLLM refuse it too: the options apply to a stream only)
            return "stream_options", "'stream_options' is only allowed when 'stream' is true"
        return None

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with token-id keys.

        Raises:
            ValueError: a key is not a token id.
        """
        out = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                out[int(k)] = v
            except ValueError:
                raise ValueError(f"key {k!r} is not a token id") from None
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def max_new_tokens(self) -> tuple[Optional[int], str]:
        """(the requested length limit or None, the parameter that gave it);
        ``max_completion_tokens`` wins over ``max_tokens``, as in mlx_lm.server."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def want_logprobs(self) -> tuple[bool, int]:
        """(send each token's log probability, how many top alternatives)."""
        raise NotImplementedError


class CompletionRequest(_Common):
    prompt: Prompt
    echo: Optional[bool] = None
    # OpenAI: the number of top alternatives (0-5); mlx_lm.server: a bool
    logprobs: Optional[Union[bool, int]] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.echo:
            return "echo", "'echo' is not supported"
        if isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool) and not (
                0 <= self.logprobs <= 20):
            return "logprobs", "Invalid value for 'logprobs': must be true, false or 0 to 20"
        if self.suffix:
            return "suffix", "'suffix' is not supported"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", "'best_of' is not supported (only equal to n)"
        return super().unsupported()

    @property
    def want_logprobs(self) -> tuple[bool, int]:
        lp, top = self.logprobs, self.top_logprobs or 0
        if isinstance(lp, bool) or lp is None:
            return bool(lp) or top > 0, top
        return True, max(lp, top)


class FunctionCall(_Lenient):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(_Lenient):
    """A tool call of an assistant message in the history."""
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_template(self) -> dict:
        """As mlx_lm.server hands it to the chat template: ``arguments`` as an
        object (templates render it with ``tojson``)."""
        args = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError("function.arguments is not valid JSON") from None
        d = {"type": "function", "function": {"name": self.function.name, "arguments": args}}
        if self.id is not None:
            d["id"] = self.id
        return d


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    def to_template(self) -> dict:
        d: dict[str, Any] = {"role": self.role,
                             "content": self.content if self.content is not None else ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef

    def to_template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.tool_choice not in (None, "auto"):
            return "tool_choice", ("only 'tool_choice': 'auto' is supported (the model decides; "
                                   "nothing forces or forbids a call)")
        if self.parallel_tool_calls is False:
            return "parallel_tool_calls", ("'parallel_tool_calls': false is not supported "
                                           "(every call the model makes is returned)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", (
                f"'response_format' of type {self.response_format.get('type')!r} is not "
                "supported: this server does not constrain decoding (only 'text')")
        for k in self.chat_template_kwargs or {}:
            if k in RESERVED_TEMPLATE_KWARGS:
                return (f"chat_template_kwargs.{k}",
                        f"'chat_template_kwargs' may not set '{k}': the server sets it")
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                return f"messages[{i}].content", f"a {m.role} message needs content"
            if m.tool_calls and m.role != "assistant":
                return f"messages[{i}].tool_calls", "only an assistant message has tool_calls"
            for j, c in enumerate(m.tool_calls or ()):
                try:
                    c.to_template()
                except ValueError as e:
                    return f"messages[{i}].tool_calls[{j}].function.arguments", str(e)
        return super().unsupported()

    @property
    def want_logprobs(self) -> tuple[bool, int]:
        top = self.top_logprobs or 0
        return bool(self.logprobs) or top > 0, top

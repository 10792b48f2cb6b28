"""Request bodies of the OpenAI endpoints ``shmcache serve`` implements.

Validation is strict (no coercion: ``"max_tokens": "5"`` or ``1.5`` is an
error, NaN and infinities are refused) and unknown fields are ignored.
Parameters that would change the output but that this server does not
implement are refused by :meth:`unsupported` rather than silently ignored.
Checks that need the backend (the model name, ``n`` against ``max_n``, token
ids against the vocabulary, what the pool can hold) are in ``validation.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MAX_INT32 = 2**31 - 1


class _Strict(BaseModel):
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
    cache_salt: Optional[str] = Field(None, min_length=1)     # the tenant's prefix-cache salt
    user: Any = None                                          # accepted and ignored
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for a parameter set to something this server does
        not implement, or None."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"'{name}' is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "'logit_bias' is not supported"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Prompt
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.echo:
            return "echo", "'echo' is not supported"
        if self.logprobs is not None:
            return "logprobs", "'logprobs' is not supported"
        if self.suffix:
            return "suffix", "'suffix' is not supported"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", "'best_of' is not supported (only equal to n)"
        return super().unsupported()


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: Optional[str] = None

    def to_template(self) -> dict:
        d = {"role": self.role, "content": self.content if self.content is not None else ""}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.logprobs:
            return "logprobs", "'logprobs' is not supported"
        if self.top_logprobs:
            return "top_logprobs", "'top_logprobs' is not supported"
        if self.tools:
            return "tools", "'tools' (function calling) is not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only the 'text' response format is supported"
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                return f"messages[{i}].content", f"a {m.role} message needs content"
        return super().unsupported()

    @property
    def max_new_tokens(self) -> tuple[Optional[int], str]:
        """(the requested length limit or None, the parameter that gave it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

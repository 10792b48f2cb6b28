"""The checks a request needs the backend for, and its prompt's token ids.

The request models (:mod:`shmcache.server.openai_types`) check the body
alone; :class:`RequestChecker` adds what depends on the backend: the model
name, ``n`` against ``max_n``, token ids against the vocabulary, and what the
pool can hold. Every problem is an :class:`~shmcache.server.http_errors.APIError`
(a 400) and the backend is not called.

Lengths: the prompt plus ``max_tokens`` (chat: ``max_completion_tokens``
first) past the model's context length (``backend.context_length``, when
known) is a 400, as OpenAI's API and vLLM answer: the model would generate
at positions it never saw in training. So is a ``max_tokens`` that the pool
can never hold. When the client gives none, the default (16 for completions
as in OpenAI's API, ``default_chat_max_tokens`` for chat) is lowered to
what the context and the pool can hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from .api import Backend
from .http_errors import APIError
from .openai_types import ChatCompletionRequest, CompletionRequest
from workers.protocol import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 512


class RequestChecker:
    """Validates requests against one backend and builds their prompts.

    Args:
        backend: the generation backend (see :class:`~shmcache.server.api.Backend`).
        served_model_name: the model name listed and echoed (default
            ``backend.model_id``; requests may name either).
        default_chat_max_tokens: a chat request's ``max_tokens`` when it gives none.
    """

    def __init__(self, backend: Backend, served_model_name: Optional[str],
                 default_chat_max_tokens: int):
        self.backend = backend
        self.model_name = served_model_name or backend.model_id
        self.accepted_models = {self.model_name, backend.model_id}
        self.tokenizer = backend.tokenizer
        self.vocab_size = int(getattr(backend, "vocab_size", None) or len(self.tokenizer))
        self.default_chat_max_tokens = default_chat_max_tokens

    def check_common(self, req) -> None:
        """The checks both endpoints share: model, unsupported parameters, ``n``,
        ``stop_token_ids``.

        Raises:
            APIError: the first problem found.
        """
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
        try:
            bias = req.logit_bias_ids()
        except ValueError as e:
            raise APIError(f"Invalid value for 'logit_bias': {e}", param="logit_bias") from None
        self.check_ids(list(bias), "logit_bias")

    def check_ids(self, ids: list[int], param: str) -> None:
        """Raises APIError naming ``param`` if a token id is outside the vocabulary."""
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise APIError(f"Invalid value for '{param}': token id {t} (at index {i}) is "
                               f"outside the vocabulary [0, {self.vocab_size}).", param=param)

    def length(self, prompt_len: int, n: int, requested: Optional[int], param: str,
               default: int, prompt_param: str) -> int:
        """The ``max_tokens`` to generate with.

        Args:
            prompt_len: the prompt's length in tokens.
            n: samples per request.
            requested: the client's value, or None.
            param: its parameter name (``max_tokens``, ``max_completion_tokens``).
            default: the value when the client gave none (lowered to what fits).
            prompt_param: the parameter to blame when the prompt alone cannot fit.

        Returns:
            ``requested``, else the largest value up to ``default`` that the
            context and the pool can hold.

        Raises:
            APIError: the prompt with ``requested`` (or with one token) is
                longer than the model's context, or the pool can never hold
                the request.
        """
        ctx = getattr(self.backend, "context_length", None)
        if ctx:
            room = ctx - prompt_len
            if room < 1:
                raise APIError(f"Invalid value for '{prompt_param}': the prompt has "
                               f"{prompt_len} tokens, which leaves no room for a reply within "
                               f"the model's context length of {ctx}.", param=prompt_param)
            if requested is not None and requested > room:
                raise APIError(f"Invalid value for '{param}': the prompt ({prompt_len} "
                               f"tokens) plus {param}={requested} is {prompt_len + requested} "
                               f"tokens, more than the model's context length of {ctx}; "
                               f"{param} may be at most {room} here.", param=param)
            default = min(default, room)
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
        """The request's sampling parameters, OpenAI's and mlx_lm.server's
        defaults filled in."""
        top_k = req.top_k or 0
        logprobs, top_logprobs = req.want_logprobs
        xtc = req.xtc_probability or 0.0
        # as mlx_lm.server: XTC never cuts a newline or an EOS
        xtc_special = (list(self.tokenizer.encode("\n", add_special_tokens=False))
                       + sorted(getattr(self.tokenizer, "eos_token_ids", None) or ())) if xtc else []
        return SamplingParams(
            max_tokens=max_tokens, n=req.n or 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k < 0 else top_k,
            min_p=req.min_p or 0.0, seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []), salt=req.cache_salt,
            repetition_penalty=req.repetition_penalty or 0.0,
            repetition_context_size=_or(req.repetition_context_size, 20),
            presence_penalty=req.presence_penalty or 0.0,
            presence_context_size=_or(req.presence_context_size, 20),
            frequency_penalty=req.frequency_penalty or 0.0,
            frequency_context_size=_or(req.frequency_context_size, 20),
            logit_bias=req.logit_bias_ids(),
            xtc_probability=xtc, xtc_threshold=_or(req.xtc_threshold, 0.1),
            xtc_special_tokens=xtc_special,
            logprobs=logprobs, top_logprobs=top_logprobs)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        """The prompt's token ids (a string is tokenized).

        Raises:
            APIError: the prompt is empty or has an id outside the vocabulary.
        """
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
        """The messages (their ``tool_calls`` too) through the tokenizer's chat
        template, with ``tools`` and ``chat_template_kwargs``, as token ids.

        Raises:
            APIError: no messages; the template failed or gave no tokens;
                ``tools`` that this model's template does not render or whose
                calls mlx-lm cannot parse back for this model.
        """
        if not req.messages:
            raise APIError("Invalid value for 'messages': the list is empty.", param="messages")
        messages = [m.to_template() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        ids = self._template(messages, kwargs, "chat_template_kwargs"
                             if req.chat_template_kwargs else "messages")
        if req.tools:
            if not getattr(self.tokenizer, "has_tool_calling", False):
                raise APIError("'tools' is not supported for this model: mlx-lm knows no "
                               "tool-call format for its chat template, so calls could not "
                               "be parsed from the answer.", param="tools")
            with_tools = self._template(
                messages, {**kwargs, "tools": [t.to_template() for t in req.tools]}, "tools")
            if with_tools == ids:
                raise APIError("'tools' is not supported for this model: its chat template "
                               "does not render tools into the prompt.", param="tools")
            ids = with_tools
        if not ids:
            raise APIError("Invalid value for 'messages': the prompt is empty.",
                           param="messages")
        return ids

    def _template(self, messages: list, kwargs: dict, blame: str) -> list[int]:
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     **kwargs)
        except Exception as e:                  # jinja errors: roles out of order, ...
            raise APIError(f"Invalid value for '{blame}': the chat template failed: {e}",
                           param=blame) from None
        return list(out["input_ids"] if isinstance(out, Mapping) else out)


def _or(v, default):
    return default if v is None else v

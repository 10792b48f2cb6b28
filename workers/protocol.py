"""What the HTTP layer and the generation backend say to each other.

The HTTP layer (``shmcache.server.app``) validates an OpenAI request, turns
it into token ids and a :class:`SamplingParams`, and iterates the backend's
``generate`` (an async generator of the events below). The backend owns the
workers and the pool: it stops a sample at EOS (or one of
``stop_token_ids``) and at ``max_tokens``; stop *strings* are the HTTP
layer's job (it detokenizes), and it closes the generator (``aclose()``)
when it no longer wants tokens, which cancels the request in its worker.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    """How a request's tokens are chosen (see :mod:`workers.worker.sampling`).

    The logits processors (``logit_bias``, the three penalties, each over
    the last ``*_context_size`` tokens of prompt + output) and the sampler
    (``temperature`` .. ``xtc_threshold``) are mlx-lm's, with its meanings
    and defaults (``mlx_lm.sample_utils``). ``logprobs``: each token's log
    probability (log-softmax of the processed logits, before temperature, as
    mlx-lm reports it) is sent with it, and the ``top_logprobs`` most likely.
    """
    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: off
    min_p: float = 0.0             # 0: off
    seed: Optional[int] = None     # None: the backend picks one
    stop_token_ids: list[int] = []
    salt: Optional[str] = None     # the tenant's prefix-cache salt (``cache_salt``)
    repetition_penalty: float = 0.0    # 0: off (mlx-lm: multiplicative, sign-aware)
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: dict[int, float] = {}
    xtc_probability: float = 0.0       # 0: off
    xtc_threshold: float = 0.1
    xtc_special_tokens: list[int] = []   # never cut by XTC (mlx_lm.server: "\n" and the EOS ids)
    logprobs: bool = False
    top_logprobs: int = 0              # the most likely alternatives sent with each token


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's log probability, and the ``top_logprobs`` most
    likely tokens at its position as (token id, log probability), most
    likely first."""
    logprob: float
    top: list[tuple[int, float]] = []


class Started(msgspec.Struct, tag="started"):
    """The request was admitted by a worker (sent once, first; a re-run after
    a worker died sends no second one and no token twice)."""
    prompt_tokens: int
    cached_tokens: int             # prompt tokens that came from the shared pool
    worker: int


class Tokens(msgspec.Struct, tag="tokens"):
    """New token ids of one sample, in order."""
    sample: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] = []   # one per token id when the request asked for them


class SampleDone(msgspec.Struct, tag="sample_done"):
    sample: int
    reason: str                    # "stop" (EOS / stop token) or "length"


class Error(msgspec.Struct, tag="error"):
    message: str
    status: int = 500              # 400: the request can never be served


Event = Union[Started, Tokens, SampleDone, Error]

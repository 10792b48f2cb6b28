"""Choosing one running sample's next token: mlx-lm's logits processors and
sampler, seeded per (request, sample, step).

A :class:`RowSampler` is built once per running sample (a row of the
engine's batch) from the request's :class:`~workers.protocol.SamplingParams`,
its seed and the sample's index. Calling it with the row's logits ``(V,)``
and the row's token history (prompt, then the tokens generated so far)
returns the next token as a lazy ``mx.array`` scalar, as
``mlx_lm.generate.generate_step`` computes it:

1. mlx-lm's logits processors (``make_logits_processors``: ``logit_bias``,
   repetition, presence and frequency penalties) over the history;
2. log-softmax;
3. greedy argmax at temperature 0, else mlx-lm's sampler (``make_sampler``:
   top-p, min-p, XTC, top-k, temperature) after ``mx.random.seed`` of
   :func:`step_seed`.

Invariant: the token depends only on the logits, the history, the params,
the seed, the sample index and the step (``len(generated)``), so a re-run
after a preemption or a worker's death, on any worker, gives the same
tokens.

With ``params.logprobs``, the token's log probability (of the processed
logits, before the temperature: what mlx-lm reports) and its
``top_logprobs`` alternatives are kept until :meth:`RowSampler.take_logprobs`.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from ..protocol import SamplingParams, TokenLogprob


def step_seed(seed: int, sample: int, step: int) -> int:
    """The random seed of one sampling step of one sample of a request."""
    return (seed * 1_000_003 + sample * 7919 + step) % (2**63)


class RowSampler:
    """One running sample's token chooser (see the module docstring).

    Args:
        params: the request's sampling parameters.
        seed: the request's seed.
        sample: the sample's index in the request (0 .. n-1).
    """

    def __init__(self, params: SamplingParams, seed: int, sample: int) -> None:
        self.params, self.seed, self.sample = params, seed, sample
        p = params
        self.greedy = p.temperature == 0
        self.sampler: Optional[Callable] = None if self.greedy else make_sampler(
            p.temperature, p.top_p, p.min_p, top_k=p.top_k,
            xtc_probability=p.xtc_probability, xtc_threshold=p.xtc_threshold,
            xtc_special_tokens=list(p.xtc_special_tokens))
        self.processors = make_logits_processors(
            logit_bias=dict(p.logit_bias) or None,
            repetition_penalty=p.repetition_penalty or None,
            repetition_context_size=p.repetition_context_size,
            presence_penalty=p.presence_penalty or None,
            presence_context_size=p.presence_context_size,
            frequency_penalty=p.frequency_penalty or None,
            frequency_context_size=p.frequency_context_size)
        # the history the processors can see: the longest context asked for
        # (mlx-lm reads a context size of 0 as the whole history)
        sizes = [s for v, s in ((p.repetition_penalty, p.repetition_context_size),
                                (p.presence_penalty, p.presence_context_size),
                                (p.frequency_penalty, p.frequency_context_size)) if v]
        self.context = None if (not sizes or 0 in sizes) else max(sizes)
        self._pending: Optional[tuple] = None    # (logprob of the token, top) of the last step

    def __call__(self, logits: mx.array, prompt: list, generated: list) -> mx.array:
        """The next token (a lazy ``mx.array`` scalar) from the row's logits ``(V,)``.

        Args:
            logits: the model's logits for the row's last position.
            prompt: the request's prompt token ids.
            generated: the tokens this sample has generated so far (their
                count is the step).
        """
        p = self.params
        if self.processors:
            history = prompt + generated
            if self.context is not None:
                history = history[-self.context:]
            tokens = mx.array(history)
            x = logits[None]
            for proc in self.processors:
                x = proc(tokens, x)
            logits = x[0]
        if self.greedy and not p.logprobs:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.greedy:
            tok = mx.argmax(logprobs, axis=-1)
        else:
            # seeded per (request, sample, step): the same tokens on any
            # worker and after any preemption
            mx.random.seed(step_seed(self.seed, self.sample, len(generated)))
            assert self.sampler is not None             # (not greedy)
            tok = self.sampler(logprobs[None])[0]
        if p.logprobs:
            top = None
            k = min(p.top_logprobs, logprobs.shape[-1])
            if k > 0:
                ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
                top = (ids, logprobs[ids])
            self._pending = (logprobs[tok], top)
        return tok

    def take_logprobs(self) -> Optional[TokenLogprob]:
        """The last token's log probability and top alternatives (most likely
        first), once; None when the request did not ask for them."""
        if self._pending is None:
            return None
        lp, top = self._pending
        self._pending = None
        pairs = []
        if top is not None:
            mx.eval(lp, *top)
            pairs = sorted(zip(top[0].tolist(), top[1].tolist()), key=lambda t: (-t[1], t[0]))
        return TokenLogprob(lp.item(), pairs)

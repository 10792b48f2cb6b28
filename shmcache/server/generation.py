"""One request's run through the backend.

:class:`Generation` iterates ``backend.generate``, feeds each sample's tokens
to its :class:`~shmcache.server.sample_text.SampleText`, and counts the
request in the metrics once. When every sample has finished, or the client
disconnects, the backend's generator is closed (which cancels the work).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import anyio

from workers.protocol import Error, SampleDone, SamplingParams, Started, Tokens
from .sample_text import SampleText

if TYPE_CHECKING:
    from .app import _Server

log = logging.getLogger("shmcache.server")

CLIENT_CLOSED = 499                    # the status counted when the client went away first


class Generation:
    """One request's run through the backend: the generator, the samples'
    text, the usage, and the metrics (counted once, by ``finish``).

    Args:
        srv: the app's server state (backend, tokenizer, eos_ids, metrics).
        endpoint: the route, for the requests counter.
        prompt: the prompt's token ids.
        params: the sampling parameters passed to ``backend.generate``.
        stops: the request's stop strings.
        t0: ``time.monotonic()`` when the request arrived (for the TTFT).
    """

    def __init__(self, srv: "_Server", endpoint: str, prompt: list[int],
                 params: SamplingParams, stops: list[str], t0: float):
        self.srv, self.endpoint, self.t0 = srv, endpoint, t0
        self.params = params
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0
        skip = frozenset(srv.eos_ids) | frozenset(params.stop_token_ids)
        self.samples = [SampleText(srv.tokenizer, stops, skip) for _ in range(params.n)]
        self.status: Optional[int] = None       # the outcome, for the requests counter
        self._pending = None
        self._first_token_seen = False
        self.ttft: Optional[float] = None       # seconds to the first token
        self.error: Optional[str] = None        # the backend's error message, if any
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
        """Waits until the backend admitted the request (``Started``).

        Returns:
            None, or the backend's ``Error``.
        """
        try:
            ev = await self._next()
        except StopAsyncIteration:
            return Error("the backend ended the request before starting it", 500)
        if isinstance(ev, Error):
            self.error = ev.message
            return ev
        if not isinstance(ev, Started):         # lenient: no Started, go on
            self._pending = ev
            ev = Started(prompt_tokens=self.prompt_tokens, cached_tokens=0, worker=-1)
        self.cached_tokens = ev.cached_tokens
        self.srv.metrics.admitted(ev.prompt_tokens, ev.cached_tokens)
        return None

    async def updates(self):
        """Yields ``(sample, text, finish_reason or None, logprobs)``, or one
        ``Error`` (last); the backend's generator is closed when this ends.
        ``logprobs`` lists ``(token id, TokenLogprob)`` of the tokens this
        update adds (empty unless the request asked for them; EOS and
        ``stop_token_ids``, which make no text, are left out; tokens after a
        stop string too)."""
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
                    self.error = ev.message
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
                self.ttft = time.monotonic() - self.t0
                self.srv.metrics.ttft.observe(self.ttft)
            self.srv.metrics.generation_tokens.inc(len(ev.token_ids))
            if s.done:
                return None
            before = s.tokens
            text = s.add(ev.token_ids)
            lps = []
            if ev.logprobs:
                taken = s.tokens - before
                lps = [(t, lp) for t, lp in zip(ev.token_ids[:taken], ev.logprobs[:taken])
                       if t not in s.skip]
            if s.done:
                return ev.sample, text, s.reason, lps
            return (ev.sample, text, None, lps) if text or lps else None
        if isinstance(ev, SampleDone):
            if ev.sample < 0:
                raise IndexError(f"sample {ev.sample}")
            s = self.samples[ev.sample]
            if s.done:
                return None
            text = s.finish("length" if ev.reason == "length" else "stop")
            return ev.sample, text, s.reason, []
        return None                             # a repeated Started: nothing to say

    def usage(self) -> dict:
        """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
        done = sum(s.tokens for s in self.samples)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    async def aclose(self) -> None:
        """Closes the backend's generator (once), which cancels its work."""
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
        """Counts the request (once) with ``status``, else its own, else 499."""
        if self._finished:
            return
        self._finished = True
        self.srv.metrics.running.dec()
        self.srv.metrics.request(self.endpoint, status or self.status or CLIENT_CLOSED)
        log_request = getattr(self.srv, "log_request", None)
        if log_request is not None:
            log_request(self.endpoint, status or self.status or CLIENT_CLOSED,
                        prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                        completion_tokens=sum(s.tokens for s in self.samples), ttft=self.ttft,
                        reason=self.error)

"""One sample's text: streaming detokenization and stop strings.

Each sample has its own streaming detokenizer, so a multi-byte character is
never split between chunks. Stop strings are matched on the sample's text:
the text ends before the stop string, and text that might be the start of a
stop string is held back while streaming until it is known not to be.
"""

from __future__ import annotations

from typing import Optional


class SampleText:
    """Detokenizes one sample and finds its stop strings.

    ``sent`` is how much of the detokenizer's text has been released; text
    after it that could still become a stop string is held back.

    Args:
        tokenizer: an mlx_lm ``TokenizerWrapper`` (``detokenizer`` gives a
            fresh streaming detokenizer).
        stops: the stop strings (none empty).
        skip_ids: token ids that produce no text (EOS, ``stop_token_ids``),
            should the backend pass them on.
    """

    def __init__(self, tokenizer, stops: list[str], skip_ids: frozenset):
        self.detok = tokenizer.detokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.skip = skip_ids
        self.sent = 0
        self.checked = 0              # text length already searched for stop strings
        self.end: Optional[int] = None
        self.reason: Optional[str] = None
        self.tokens = 0

    @property
    def done(self) -> bool:
        """The sample has its finish reason; later token ids are ignored."""
        return self.reason is not None

    def add(self, ids) -> str:
        """Feeds token ids; returns the text now safe to release. Sets
        ``reason = 'stop'`` when a stop string completed (later ids ignored)."""
        for t in ids:
            if self.reason is not None:
                break
            self.tokens += 1
            if t in self.skip:        # EOS / stop token, should the backend pass it on
                continue
            self.detok.add_token(t)
            if self.stops:
                self._find_stop()
        return self._release(final=False)

    def finish(self, reason: str) -> str:
        """The backend finished this sample; returns the rest of its text."""
        if self.reason is None:
            self.detok.finalize()
            if self.stops:
                self._find_stop()
            if self.reason is None:
                self.reason = reason
        return self._release(final=True)

    def _find_stop(self) -> None:
        text = self.detok.text
        if len(text) <= self.checked:
            return
        # A match must end in the new text, so it starts at most ``hold``
        # characters before it (and never in text already released).
        start = max(self.sent, self.checked - self.hold)
        self.checked = len(text)
        best = -1
        for s in self.stops:
            i = text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        if best != -1:
            self.end, self.reason = best, "stop"

    def _release(self, final: bool) -> str:
        text = self.detok.text
        if self.end is not None:
            upto = self.end
        elif final or not self.stops:
            upto = len(text)
        else:
            upto = len(text) - self._held(text)
        if upto <= self.sent:
            return ""
        out, self.sent = text[self.sent:upto], upto
        return out

    def _held(self, text: str) -> int:
        """The longest tail of the unreleased text that starts a stop string."""
        for k in range(min(self.hold, len(text) - self.sent), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

"""What the HTTP layer (``shmcache.server.app``) needs from a generation backend.

The real backend is ``workers.supervisor.backend.WorkerBackend`` (worker
processes over the shared pool); the HTTP tests use a fake. Both are
duck-typed against :class:`Backend`; nothing has to inherit from it.

Cancellation: when the HTTP layer no longer wants a request's tokens (every
sample finished on a stop string, the client went away, the server is
shutting down) it either calls ``aclose()`` on the generator returned by
``generate`` (``GeneratorExit`` at the ``yield`` it is suspended in) or
cancels the task that is awaiting it (``CancelledError`` at the ``await`` it
is suspended in). Either way the generator's ``finally`` runs, and that is
where the backend cancels the work in its worker. The cancellation may be
re-delivered at every further ``await`` of that ``finally``, so the clean-up
should not need to wait (send a cancel message without awaiting, or shield
it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Optional, Protocol, runtime_checkable

from workers.protocol import Event, SamplingParams

if TYPE_CHECKING:                                    # mlx_lm is heavy: types only
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@runtime_checkable
class Backend(Protocol):
    model_id: str
    """The model name ``/v1/models`` lists and that requests may name."""

    tokenizer: "TokenizerWrapper"
    """As ``mlx_lm.load`` returns it (``detokenizer`` gives a fresh streaming
    detokenizer per call, ``eos_token_ids``, ``apply_chat_template``)."""

    max_n: int
    """The largest ``n`` (samples per request) accepted."""

    def admission_error(self, prompt_tokens: int, max_tokens: int, n: int) -> Optional[str]:
        """None, or why the pool can never hold this request (HTTP 400).

        Must be cheap and free of side effects: the HTTP layer may call it a
        few times per request (to cap a default ``max_tokens`` it chose
        itself, and to name the parameter at fault)."""

    def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Event]:
        """An async generator: ``Started`` first, then ``Tokens`` and one
        ``SampleDone`` per sample (``sample`` in ``range(params.n)``), or an
        ``Error``. Each sample stops at EOS / ``stop_token_ids`` and at
        ``max_tokens``; stop strings are the HTTP layer's job. See the module
        docstring for how a request is cancelled."""

    def stats(self) -> dict:
        """Gauges for ``/metrics`` and ``/health``: ``blocks_total``,
        ``blocks_used``, ``blocks_free``, ``blocks_cached``, ``preemptions``,
        ``worker_restarts``, ``workers_alive`` (ints; ``preemptions`` and
        ``worker_restarts`` are counts since start)."""

    async def start(self) -> None:
        """Create the pool and start the workers (called once, before the
        first request)."""

    async def close(self) -> None:
        """Stop the workers and remove the pool from /dev/shm. Called once at
        shutdown, also after a ``start`` that raised."""

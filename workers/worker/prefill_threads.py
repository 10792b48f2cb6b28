"""A prefill's elementwise work spread over several MLX CPU threads.

On a CPU, MLX hands the matrix products to the BLAS, which runs them on its
threads, and runs every other operation of a stream on that stream's one
thread, element by element. In a long prefill two of those operations are
dear: attention's softmax (one exponential per query-key pair) and the SiLU
of the SwiGLU MLP (one per hidden unit). On Qwen2.5-0.5B's shape, a
448-token prefill on 2 BLAS threads spends about 60% of its time in them
(per layer 49 ms of attention, 40 of them the softmax, and 39 ms of SiLU,
against about 35 ms of products; ``docs/decisions/0021-prefill-threads.md``),
and more BLAS threads cannot shorten it.

Each MLX CPU stream has its own thread. So this module splits those two
operations by rows (token rows; attention's query rows) into parts, one
part per stream, and joins the parts; MLX runs the parts at once, on as many
cores. The matrix products are left whole, on the caller's stream.

Invariant: the results are the bits mlx-lm's own functions give, so greedy
tokens stay equal to mlx-lm's ``generate``. Every element still goes through
the same kernel: the SiLU and product per element; attention through the
operations of MLX's CPU ``scaled_dot_product_attention`` (it has no fused CPU
kernel; it composes the scale, the ``Q Kᵀ`` product, the mask, a precise
softmax per row and the product with ``V``), in the same order, with only
the mask and the softmax split, row by row. Because that composition is
MLX's and may change in another version, :func:`install` first compares the
split functions with mlx-lm's on random inputs (causal, boolean and additive
masks, grouped heads) and installs nothing when a single bit differs.

How: mlx-lm's model modules call ``swiglu`` and
``scaled_dot_product_attention`` by their module-global names (``from
.activations import swiglu``). :func:`install` rebinds those names, in the
modules of the model's own classes only, to the split functions; steps with
fewer than ``2 * MIN_PART_ROWS`` rows (every decode step), and attention
whose scores pass ``MAX_SPLIT_SCORES_BYTES`` (a long context: the split
joins a second copy of them), go straight to mlx-lm's. :func:`uninstall`
puts them back.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import mlx.core as mx
import mlx_lm.models.activations as _activations
import mlx_lm.models.base as _base

log = logging.getLogger(__name__)

MIN_PART_ROWS = 16      # rows of one part: below, a thread's start costs more than it saves
#: the largest attention scores (B x Hq x L x S elements, in bytes) that are
#: split: the parts' softmax is joined into a second copy of the scores, so a
#: split prefill holds up to this much more memory than mlx-lm's for a moment
#: (with 14 query heads and 512-token steps: contexts up to about 9,000 tokens)
MAX_SPLIT_SCORES_BYTES = 256 << 20

_mlx_swiglu: Any = _activations.swiglu
_mlx_sdpa: Any = _base.scaled_dot_product_attention   # (its mask may be a str too)


class _Split:
    """The split functions over ``threads`` CPU streams (part 0 on the
    caller's own stream)."""

    def __init__(self, threads: int):
        self.threads = threads
        self.streams = [mx.new_stream(mx.cpu) for _ in range(threads - 1)]
        self.calls = 0          # calls that split (a counter, for tests and logs)

    def _parts(self, rows: int) -> list:
        """``[(stream or None, start, stop)]``: ``rows`` cut into at most
        ``threads`` parts of at least MIN_PART_ROWS rows."""
        n = min(self.threads, rows // MIN_PART_ROWS)
        step = -(-rows // n)
        return [(None if i == 0 else self.streams[i - 1], a, min(a + step, rows))
                for i, a in enumerate(range(0, rows, step))]

    def swiglu(self, gate: mx.array, x: mx.array) -> mx.array:
        # gate, x: (..., T, F)
        rows = gate.shape[-2] if gate.ndim >= 2 else 0
        if rows < 2 * MIN_PART_ROWS or gate.shape != x.shape:
            return _mlx_swiglu(gate, x)
        self.calls += 1
        out = []
        for s, a, b in self._parts(rows):
            with mx.stream(s or mx.default_stream(mx.cpu)):
                out.append(_mlx_swiglu(gate[..., a:b, :], x[..., a:b, :]))
        return mx.concatenate(out, axis=-2)

    def sdpa(self, queries, keys, values, cache, scale: float, mask, sinks=None):
        # queries: (B, Hq, L, D); keys, values: (B, Hkv, S, D)
        if queries.ndim != 4 or keys.ndim != 4:
            return _mlx_sdpa(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        L = queries.shape[2]
        scores_bytes = queries.size // queries.shape[-1] * keys.shape[2] * queries.itemsize
        if (L < 2 * MIN_PART_ROWS or sinks is not None or hasattr(cache, "bits")
                or queries.shape[1] % keys.shape[1] or scores_bytes > MAX_SPLIT_SCORES_BYTES
                or (isinstance(mask, str) and mask != "causal")):
            return _mlx_sdpa(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        self.calls += 1
        B, Hq, _, D = queries.shape
        Hkv, S = keys.shape[1], keys.shape[2]
        rep = Hq // Hkv
        q = mx.array(scale, dtype=queries.dtype) * queries
        k, v = keys, values
        if rep > 1:
            q = q.reshape(B, Hkv, rep, L, D)                    # (B, Hkv, rep, L, D)
            k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)   # (B, Hkv, 1, S, D)
        scores = q @ mx.swapaxes(k, -1, -2)                     # (..., L, S)
        if isinstance(mask, str):
            m: Optional[mx.array] = (mx.arange(S - L, S)[:, None] >= mx.arange(S)[None])  # (L, S)
        elif mask is not None:
            m = mask if mask.dtype == mx.bool_ else mask.astype(scores.dtype)
            m = mx.broadcast_to(m, (B, Hq, L, S))
            if rep > 1:
                m = m.reshape(B, Hkv, rep, L, S)
        else:
            m = None
        low = mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype)
        out = []
        for s, a, b in self._parts(L):
            with mx.stream(s or mx.default_stream(mx.cpu)):
                part = scores[..., a:b, :]
                if m is not None:
                    mp = m[..., a:b, :]
                    part = mx.where(mp, part, low) if m.dtype == mx.bool_ else part + mp
                out.append(mx.softmax(part, axis=-1, precise=True))
        o = mx.concatenate(out, axis=-2) @ v                    # (..., L, D)
        return o.reshape(B, Hq, L, D) if rep > 1 else o


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


_installed: dict = {}          # module name -> {name rebound: mlx-lm's function}


def _agrees(split: _Split) -> Optional[str]:
    """None when the split functions give mlx-lm's bits on random inputs,
    else what differed."""
    key = mx.random.key(7)
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    gate = mx.random.normal((2, 80, 96), key=k1)
    x = mx.random.normal((2, 80, 96), key=k2)
    if not mx.array_equal(split.swiglu(gate, x), _mlx_swiglu(gate, x)).item():
        return "swiglu"
    q = mx.random.normal((2, 6, 80, 32), key=k3)
    k = mx.random.normal((2, 2, 96, 32), key=k4)
    v = mx.random.normal((2, 2, 96, 32), key=k5)
    pad = mx.arange(96)[None, None, None, :] >= mx.array([0, 9])[:, None, None, None]
    causal = mx.arange(16, 96)[:, None] >= mx.arange(96)[None]
    masks = {"none": None, "causal": "causal", "boolean": pad & causal,
             "additive": mx.where(pad & causal, 0.0, -1e9)}
    for heads in (q, q[:, :2]):          # grouped (3 query heads a KV head), and not
        for name, mask in masks.items():
            got = split.sdpa(heads, k, v, None, scale=0.17, mask=mask)
            want = _mlx_sdpa(heads, k, v, None, scale=0.17, mask=mask)
            if not mx.array_equal(got, want).item():
                return f"attention ({name} mask, {heads.shape[1]} query heads)"
    return None


def install(model, threads: int) -> int:
    """Split ``model``'s prefill softmax and SiLU over ``threads`` CPU
    threads. Returns the threads in use: ``threads``, or 1 when ``threads``
    is 1, MLX computes on another device than the CPU (a GPU runs these
    operations in parallel already), the model's modules call neither
    function, or the split results differ from mlx-lm's on this machine
    (logged; nothing installed)."""
    uninstall()
    if threads <= 1 or not _on_cpu():
        return 1
    split = _Split(threads)
    bad = _agrees(split)
    if bad is not None:
        log.warning("prefill threads off: the split %s differs from mlx-lm's on this "
                    "machine's MLX; prefills run on one thread", bad)
        return 1
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        mod = sys.modules.get(name)
        for fn, mine, theirs in (("swiglu", split.swiglu, _mlx_swiglu),
                                 ("scaled_dot_product_attention", split.sdpa, _mlx_sdpa)):
            if getattr(mod, fn, None) is theirs:
                _installed.setdefault(name, {})[fn] = theirs
                setattr(mod, fn, mine)
    return threads if _installed else 1


def uninstall() -> None:
    """Every module :func:`install` changed gets mlx-lm's functions back."""
    for name, rebound in _installed.items():
        for fn, theirs in rebound.items():
            setattr(sys.modules[name], fn, theirs)
    _installed.clear()

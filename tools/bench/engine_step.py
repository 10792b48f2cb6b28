"""One worker's step cost against mlx-lm's own batched generation, in this process.

    python -m tools.bench.engine_step [--model realistic:6] [--batch 1,2,4,8]
                                      [--context 550] [--tokens 32] [--rounds 2]

For each batch size B: B random prompts of --context tokens (the same for
both), then --tokens greedy tokens each, run by

* mlx-lm: ``mlx_lm.generate.BatchGenerator`` with its defaults (what
  ``mlx_lm.server`` runs a batch with), and
* shmcache: the worker's :class:`~workers.worker.engine.Engine` over a fresh
  pool (prefill written through to the pool, every decode step reserving,
  committing and publishing blocks), as ``shmcache serve`` runs it.

It prints the median decode step (over the steps after the first few, when
every row is decoding), the tokens per second of the batch at that step,
and the whole run's seconds, min-max over rounds, and the ratio
shmcache/mlx-lm paired by round. It answers two questions the serving
benchmark cannot separate: does a worker's step cost more than mlx-lm's
(the pool's bookkeeping), and how does a step's cost grow with the rows in
it (a CPU decode step is bound by reading the weights, so more rows cost
little more)? The pool it makes is removed, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time


def _decode_median(step_s: list, tokens: int) -> float:
    tail = step_s[-(tokens - 4):] if tokens > 8 else step_s[-1:]
    return statistics.median(tail)


def run_mlx_lm(model, prompts: list, tokens: int) -> tuple:
    from mlx_lm.generate import BatchGenerator
    b = len(prompts)
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=max(32, b),
                         prefill_batch_size=max(8, b))
    gen.insert(prompts, max_tokens=[tokens] * b)
    steps, done = [], 0
    t0 = time.perf_counter()
    while done < b:
        t = time.perf_counter()
        out = gen.next_generated()
        steps.append(time.perf_counter() - t)
        done += sum(1 for r in out if r.finish_reason is not None)
    return _decode_median(steps, tokens), time.perf_counter() - t0


def run_engine(model, prompts: list, tokens: int, layout: dict) -> tuple:
    import shmcache
    from workers.protocol import SamplingParams
    from workers.wire import Gen
    from workers.worker.engine import Engine
    context = max(len(p) for p in prompts) + tokens
    blocks = len(prompts) * (context // 16 + 2) + 64
    name = f"bench-step-{os.getpid()}"
    mgr = shmcache.create_pool(name, block_size=16, max_blocks=blocks, **layout)
    try:
        failed: list = []
        eng = Engine(mgr, model, [], lambda kind, payload: failed.append(payload)
                     if kind == "failed" else None)
        for i, p in enumerate(prompts):
            eng.submit(Gen(i + 1, list(p), SamplingParams(max_tokens=tokens, temperature=0.0), 1))
        steps = []
        t0 = time.perf_counter()
        while eng.busy:
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        eng.close()
        if failed:
            raise RuntimeError(f"the engine failed a request: {failed[0]}")
        return _decode_median(steps, tokens), wall
    finally:
        mgr.destroy()                   # (removes the segment: this manager created it)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.engine_step",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="realistic:6",
                    help="demo, realistic[:LAYERS] or an mlx-lm model directory "
                         "(default realistic:6)")
    ap.add_argument("--batch", default="1,2,4,8", help="batch sizes (default 1,2,4,8)")
    ap.add_argument("--context", type=int, default=550, help="prompt tokens (default 550)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per row (default 32)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        batches = [int(x) for x in args.batch.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        ap.error(f"--batch {args.batch}: want positive integers, e.g. 1,2,4")
    if args.context < 2 or args.tokens < 2 or args.rounds < 1:
        ap.error("need --context >= 2, --tokens >= 2 and --rounds >= 1")

    import shmcache  # noqa: F401  (binds the fast BLAS before mlx loads)
    import mlx.core as mx
    from mlx_lm import load
    from shmcache.models.mlx_lm import pool_layout
    from tools.bench.serve_models import ModelError, resolve
    try:
        path, label = resolve(args.model)
    except ModelError as e:
        print(f"engine_step: {e}", file=sys.stderr)
        return 2
    model, _ = load(path)
    mx.eval(model.parameters())
    layout = pool_layout(model)       # the pool a worker would attach to
    vocab = model.args.vocab_size
    print(f"model: {label}; context {args.context} tokens, {args.tokens} generated per row; "
          f"{os.cpu_count()} cores", flush=True)
    for b in batches:
        rng = random.Random(f"{args.seed}-{b}")
        # ids from 3: the low ids are special tokens in most vocabularies
        prompts = [[rng.randrange(3, vocab) for _ in range(args.context)] for _ in range(b)]
        res: dict = {"mlx-lm": [], "shmcache": []}
        for _ in range(args.rounds):
            res["mlx-lm"].append(run_mlx_lm(model, prompts, args.tokens))
            res["shmcache"].append(run_engine(model, prompts, args.tokens, layout))
        ratio = [s[0] / m[0] for s, m in zip(res["shmcache"], res["mlx-lm"])]
        line = [f"B={b}"]
        for k, v in res.items():
            step = [x[0] * 1000 for x in v]
            wall = [x[1] for x in v]
            line.append(f"{k}: step {min(step):.1f}-{max(step):.1f} ms "
                        f"({b * 1000 / max(step):.1f}-{b * 1000 / min(step):.1f} tok/s), "
                        f"run {min(wall):.2f}-{max(wall):.2f} s")
        line.append(f"step shmcache/mlx-lm {min(ratio):.2f}-{max(ratio):.2f}x")
        print("; ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

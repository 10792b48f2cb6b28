"""How a machine's decode and prefill throughput scale with processes, BLAS threads and rows.

    python -m tools.bench.decode_scaling [--model realistic:6] [--configs 8x2x2,4x2x4]
                                         [--context 500] [--steps 24] [--prefill 128]
                                         [--busy 4x2x8] [--pin]

Each config ``PxTxB`` starts P processes at once, each with T BLAS threads
(``SHMCACHE_BLAS_THREADS``), each holding B rows of --context random tokens
in mlx-lm's ``BatchKVCache``. When all are ready they decode --steps
greedy steps together; then each prefills --prefill new tokens for one row,
three times, and then times the same prefill's matrix products alone (every
float ``Linear`` of the layers, on --prefill random rows). It prints, per
config, the median decode step, the machine's decode tokens per second (the
sum over processes of B / step), its prefill tokens per second, and the share
of a prefill that those products (the BLAS) take.

``--busy QxUxS`` times the decode steps beside Q more processes that
prefill all the while, as a server's prefilling workers do: each with U
BLAS threads and S prefill threads (``workers/worker/prefill_threads.py``,
the split softmax and SiLU; 1: off), each holding --context tokens and
computing --prefill more on top of them, again and again (the cache
trimmed back after each). It adds their prefill tokens per second. With
``--pin`` every process runs on CPUs of its own (``sched_setaffinity``: a
decoding process on T of this process's CPUs, a busy one on U, in order),
so the two kinds cannot take each other's cores; the configs must then
fit the machine.

It answers what the serving benchmark cannot separate: is a CPU decode
step bound by the memory bus of the whole machine (then fewer, fuller
batches produce more tokens per second, even with cores idle), or by each
process's cores (then spreading rows over every core is best)? And does a
prefill gain from BLAS threads? Only its matrix products run on them; MLX's
other CPU operations (attention's softmax, the activations, the norms) run
on one thread, so where the BLAS share is small, more threads cannot help
and only more processes can.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _pin(cores: str) -> None:
    """Run this process (and the threads it starts later) on ``cores``
    ("": anywhere; else comma-separated CPU numbers)."""
    if cores:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])


def child(model_dir: str, rows: int, context: int, steps: int, prefill: int,
          cores: str = "") -> None:
    _pin(cores)
    import shmcache  # noqa: F401  (binds the BLAS before mlx loads)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    model, _ = load(model_dir)
    vocab = model.args.vocab_size
    mx.random.seed(os.getpid())
    caches = [BatchKVCache([0] * rows) for _ in model.layers]
    toks = mx.random.randint(0, vocab, (rows, context))            # (B, T)
    _fill(model, caches, toks)
    y = toks[:, -1:]
    print("ready", flush=True)
    sys.stdin.readline()                 # every process starts together
    step_s = []
    for _ in range(steps):
        t = time.perf_counter()
        y = mx.argmax(model(y, cache=caches)[:, -1, :], axis=-1)[:, None]
        mx.eval(y)
        step_s.append(time.perf_counter() - t)
    print("ready", flush=True)
    sys.stdin.readline()
    pre_s = []
    for _ in range(3):
        cache = make_prompt_cache(model)
        p = mx.random.randint(0, vocab, (1, prefill))
        t = time.perf_counter()
        model(p, cache=cache)
        mx.eval([a for c in cache for a in (c.keys, c.values)])
        pre_s.append(time.perf_counter() - t)
    print(json.dumps({"step": statistics.median(step_s[2:]), "prefill": statistics.median(pre_s),
                      "prefill_blas": _products_s(model, prefill),
                      "cores": sorted(os.sched_getaffinity(0))}), flush=True)


def _fill(model, cache: list, toks) -> None:
    """Computes ``toks`` (B, T) into ``cache``, 512 tokens a step."""
    import mlx.core as mx
    for s in range(0, toks.shape[1], 512):
        model(toks[:, s:s + 512], cache=cache)
        mx.eval([a for c in cache for a in (c.keys, c.values)])


def busy_child(model_dir: str, context: int, prefill: int, split_threads: int,
               cores: str = "") -> None:
    """A prefilling process for ``--busy``: ready, then on "go" prefills
    ``prefill`` tokens over a ``context``-token cache until "stop" arrives
    on stdin; prints its prefill tokens per second."""
    _pin(cores)
    import select

    import shmcache  # noqa: F401  (binds the BLAS before mlx loads)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from workers.worker import prefill_threads

    model, _ = load(model_dir)
    prefill_threads.install(model, split_threads)
    vocab = model.args.vocab_size
    mx.random.seed(os.getpid())
    cache = make_prompt_cache(model)
    _fill(model, cache, mx.random.randint(0, vocab, (1, context)))    # (1, T)
    p = mx.random.randint(0, vocab, (1, prefill))
    print("ready", flush=True)
    sys.stdin.readline()
    done, t0 = 0, time.perf_counter()
    while not select.select([sys.stdin], [], [], 0)[0]:
        model(p, cache=cache)
        mx.eval([a for c in cache for a in (c.keys, c.values)])
        for c in cache:
            c.trim(prefill)
        done += 1
    print(json.dumps({"prefill_tok_s": done * prefill / (time.perf_counter() - t0),
                      "cores": sorted(os.sched_getaffinity(0))}), flush=True)


def _products_s(model, tokens: int) -> float:
    """Seconds of a ``tokens``-row prefill's matrix products alone: every
    float ``Linear`` weight of the layers times ``tokens`` random rows,
    evaluated together (median of 3; quantized layers are left out)."""
    import mlx.core as mx
    import mlx.nn as nn

    weights = [m.weight for layer in model.layers for _, m in layer.named_modules()
               if type(m) is nn.Linear]
    xs = {w.shape[1]: mx.random.normal((tokens, w.shape[1])) for w in weights}   # (T, in)
    mx.eval(list(xs.values()))
    out = []
    for _ in range(3):
        t = time.perf_counter()
        mx.eval([xs[w.shape[1]] @ w.T for w in weights])
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _core_sets(counts: list, pin: bool) -> list:
    """For each of ``counts``, that many CPUs of this process's own, none
    given twice, as "a,b,..." ("" each without ``pin``)."""
    if not pin:
        return [""] * len(counts)
    cpus = sorted(os.sched_getaffinity(0))
    out, at = [], 0
    for n in counts:
        out.append(",".join(str(c) for c in cpus[at:at + n]))
        at += n
    return out


def _expect_ready(ps: list, what: str) -> None:
    for p in ps:
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"a child failed ({what}): {line!r}")


def _send(ps: list, word: str) -> None:
    for p in ps:
        p.stdin.write(word + "\n")
        p.stdin.flush()


def run_config(model_dir: str, procs: int, threads: int, rows: int, args) -> dict:
    busy = args.busy_config
    n_busy, busy_threads, busy_split = busy if busy else (0, 0, 0)
    cores = _core_sets([threads] * procs + [busy_threads] * n_busy, args.pin)
    env = dict(os.environ, SHMCACHE_BLAS_THREADS=str(threads))
    me = [sys.executable, "-m", "tools.bench.decode_scaling"]
    ps = [subprocess.Popen(me + ["--child", model_dir, str(rows), str(args.context),
                                 str(args.steps), str(args.prefill), cores[i]],
                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
          for i in range(procs)]
    benv = dict(os.environ, SHMCACHE_BLAS_THREADS=str(busy_threads))
    bs = [subprocess.Popen(me + ["--busy-child", model_dir, str(args.context), str(args.prefill),
                                 str(busy_split), cores[procs + i]],
                           env=benv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
          for i in range(n_busy)]
    try:
        _expect_ready(ps + bs, "loading")
        _send(bs, "go")
        if bs:
            time.sleep(0.5)              # the busy ones in their stride before the steps
        _send(ps, "go")                  # decode steps
        _expect_ready(ps, "decoding")
        _send(bs, "stop")
        busy_res = [json.loads(b.stdout.readline()) for b in bs]
        _send(ps, "go")                  # their own prefills, the busy ones stopped
        res = [json.loads(p.stdout.readline()) for p in ps]
    finally:
        for p in ps + bs:
            p.kill()
            p.wait()
    if args.pin:                         # each ran where it was put
        for r, want in zip(res + busy_res, cores):
            if r["cores"] != [int(c) for c in want.split(",")]:
                raise RuntimeError(f"a child ran on CPUs {r['cores']}, not {want}")
    step = statistics.median(r["step"] for r in res)
    return {"config": f"{procs}x{threads}x{rows}", "step_ms": step * 1000,
            "decode_tok_s": sum(rows / r["step"] for r in res),
            "prefill_tok_s": sum(args.prefill / r["prefill"] for r in res),
            "prefill_blas_pct": 100 * statistics.median(r["prefill_blas"] / r["prefill"]
                                                        for r in res),
            "busy_prefill_tok_s": sum(r["prefill_tok_s"] for r in busy_res)}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        a = sys.argv[2:]
        child(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), a[5] if len(a) > 5 else "")
        return 0
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--busy-child":
        a = sys.argv[2:]
        busy_child(a[0], int(a[1]), int(a[2]), int(a[3]), a[4] if len(a) > 4 else "")
        return 0
    ap = argparse.ArgumentParser(prog="python -m tools.bench.decode_scaling",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="realistic:6", help="demo, realistic[:LAYERS] or a directory")
    ap.add_argument("--configs", default="8x2x2,4x2x4,4x4x4,8x2x4,16x1x1,1x16x16",
                    help="comma-separated PxTxB: processes x BLAS threads x rows")
    ap.add_argument("--context", type=int, default=500, help="tokens each row holds (default 500)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed (default 24)")
    ap.add_argument("--prefill", type=int, default=128, help="tokens of each prefill (default 128)")
    ap.add_argument("--rounds", type=int, default=1, help="times each config runs (default 1)")
    ap.add_argument("--busy", metavar="QxUxS",
                    help="Q more processes prefilling during the decode steps, U BLAS threads "
                         "and S prefill threads each (default: none)")
    ap.add_argument("--pin", action="store_true",
                    help="every process on cores of its own (the configs must fit the machine)")
    args = ap.parse_args(argv)
    try:
        configs = [tuple(int(x) for x in c.lower().split("x")) for c in args.configs.split(",")]
        if any(len(c) != 3 or min(c) < 1 for c in configs):
            raise ValueError
    except ValueError:
        print(f"decode_scaling: --configs {args.configs!r}: expected PxTxB,... of positive "
              "integers", file=sys.stderr)
        return 2
    args.busy_config = None
    if args.busy:
        try:
            args.busy_config = tuple(int(x) for x in args.busy.lower().split("x"))
            if len(args.busy_config) != 3 or min(args.busy_config) < 1:
                raise ValueError
        except ValueError:
            print(f"decode_scaling: --busy {args.busy!r}: expected QxUxS of positive integers",
                  file=sys.stderr)
            return 2
    if args.pin:
        from workers.supervisor.worker_procs import cpus_available
        extra = args.busy_config[0] * args.busy_config[1] if args.busy_config else 0
        over = [f"{p}x{t}x{b}" for p, t, b in configs if p * t + extra > cpus_available()]
        if over:
            print(f"decode_scaling: --pin: {', '.join(over)} (with --busy) need more than this "
                  f"machine's {cpus_available()} CPUs", file=sys.stderr)
            return 2
    if args.steps < 3:
        print(f"decode_scaling: --steps {args.steps}: at least 3 (the first two are warm-up)",
              file=sys.stderr)
        return 2
    from tools.bench.serve_models import resolve
    model_dir, label = resolve(args.model)
    print(f"model {label}; {os.cpu_count()} cores; context {args.context}, "
          f"{args.steps} steps, prefill {args.prefill}"
          + (f"; busy {args.busy}" if args.busy else "") + ("; pinned" if args.pin else ""),
          flush=True)
    print("config (PxTxB) | step ms | decode tok/s | prefill tok/s | prefill in BLAS %"
          + (" | busy prefill tok/s" if args.busy else ""), flush=True)
    for r in range(args.rounds):
        for procs, threads, rows in configs:
            out = run_config(model_dir, procs, threads, rows, args)
            busy = f" | {out['busy_prefill_tok_s']:19.1f}" if args.busy else ""
            print(f"{out['config']:>14} | {out['step_ms']:7.1f} | {out['decode_tok_s']:12.1f} | "
                  f"{out['prefill_tok_s']:13.1f} | {out['prefill_blas_pct']:17.0f}{busy}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Memory of N processes holding one model: private copies (mlx_lm.load) against
one shared mapping (shmcache.models.weights.load_model_shared), and decode speed of each.

    python -m tools.bench.weights [--model DIR] [--layers 24] [--n 1,2,4] [--rounds 2]

Without --model it builds (once, under --workdir) a random model of
Qwen2.5-0.5B's shape (qwen2, hidden 896, 14 heads over 2 KV heads, head_dim
64, MLP 4864, float32) with --layers layers. For each mode and N it starts N
processes that load the model and run one forward pass (every weight page is
touched), then reads each one's PSS (psutil memory_full_info().pss) and
prints the sum. Then, per round, one process of each mode decodes
--tokens tokens greedily (mlx_lm.stream_generate) and prints its tok/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

QWEN05 = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
              intermediate_size=4864)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def child(mode: str, model_dir: str, decode_tokens: int) -> None:
    import shmcache  # noqa: F401  (binds the fast BLAS before mlx loads)
    import mlx.core as mx
    if mode == "shared":
        from shmcache.models.weights import load_model_shared
        model, tok = load_model_shared(model_dir)
    else:
        from mlx_lm import load
        model, tok = load(model_dir)
    mx.eval(model(mx.array([tok.encode(PROMPT)])))
    out = {"ready": True}
    if decode_tokens:
        from mlx_lm import stream_generate
        last = None
        for last in stream_generate(model, tok, PROMPT, max_tokens=decode_tokens):
            pass
        out.update(decode_tps=last.generation_tps, tokens=last.generation_tokens)
    print(json.dumps(out), flush=True)
    sys.stdin.read()


def start(mode, model_dir, decode_tokens=0):
    return subprocess.Popen([sys.executable, "-m", "tools.bench.weights", "--child", mode, model_dir,
                             str(decode_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--workdir", default="/tmp/shmcache-bench-weights")
    ap.add_argument("--n", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    import psutil

    model_dir = args.model
    if model_dir is None:
        from shmcache.models.demo_model import build_model_dir
        d = Path(args.workdir) / f"qwen05-shape-{args.layers}L"
        if not (d / "model.safetensors").exists():
            build_model_dir(d, "qwen2", num_hidden_layers=args.layers, **QWEN05)
        model_dir = str(d)
    size = sum(f.stat().st_size for f in Path(model_dir).glob("model*.safetensors"))
    print(f"model {model_dir}: {size / 1e9:.2f} GB of safetensors")
    for mode in ("private", "shared"):
        for n in (int(x) for x in args.n.split(",")):
            procs = [start(mode, model_dir) for _ in range(n)]
            try:
                t0 = time.monotonic()
                for p in procs:
                    assert json.loads(p.stdout.readline())["ready"]
                pss = [psutil.Process(p.pid).memory_full_info().pss for p in procs]
                print(f"{mode:8s} N={n}: summed PSS {sum(pss) / 1e9:.2f} GB "
                      f"(per process {', '.join(f'{x / 1e9:.2f}' for x in pss)}; "
                      f"all ready in {time.monotonic() - t0:.1f} s)", flush=True)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    for r in range(args.rounds):
        for mode in ("private", "shared"):
            p = start(mode, model_dir, args.tokens)
            try:
                res = json.loads(p.stdout.readline())
            finally:
                p.kill()
                p.wait()
            print(f"round {r + 1} {mode:8s}: decode {res['decode_tps']:.2f} tok/s "
                  f"({res['tokens']} tokens)", flush=True)


if __name__ == "__main__":
    main()

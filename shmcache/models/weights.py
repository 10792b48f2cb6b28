"""One copy of a model's weights for every process that serves it.

:func:`load_model_shared` does what ``mlx_lm.load`` does (config, model class,
``sanitize``, quantization from the config with its per-layer overrides,
``load_weights``, the tokenizer through mlx-lm's loader), except where the
weights live: each tensor of the safetensors files is an MLX array over one
read-only mapping of the file (``mmap`` PROT_READ, MAP_SHARED, made by
``shmcache._mlxbuf.map_file``). The mapped pages are the page cache's, one
copy for all processes that map the file; a process's PSS counts its 1/N
share. ``mlx_lm.load`` instead copies every tensor into memory of its own.

Invariants:

- A mapped array is never written. MLX treats it as memory it does not own:
  it frees nothing into its allocator and never donates the buffer to an
  op's output, so ops (casts, ``nn.quantize``, ``load_weights``) make new
  arrays. The mapping is read-only: a write through some other path (a
  writable numpy view of a weight) faults instead of changing the file.
- The arrays keep the mapping alive; it is unmapped when the last one is
  freed. Nothing is left behind when a process dies: there is nothing to
  clean up, and a killed worker changes nothing for the others.
- A tensor is mapped only at an offset that is a multiple of its item size
  (what MLX's kernels assume). ``mx.save_safetensors`` (mlx-lm's converter,
  ``shmcache.models.demo_model``) writes an unpadded header, so its tensors rarely
  are: such a file is first rewritten once, with every tensor at a multiple
  of :data:`ALIGN`, into :func:`aligned_dir` (keyed by the source's path,
  size, mtime and inode, written under a file lock by the first process,
  reused by the rest; a copy whose source is gone or changed is removed at
  the next write), and that copy is mapped. Files that are aligned already
  (Hugging Face's writer pads its header, ``shmcache.models.demo_model`` writes
  aligned) are mapped in place.
- What this path does not cover (a config that names a ``model_file``,
  legacy ``quantization_config`` formats, activation quantization, a dtype
  that MLX cannot map, ``shmcache._mlxbuf`` not usable or ``SHMCACHE_PURE``
  set) falls back to ``mlx_lm.load``, with the reason logged as a warning.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

__all__ = ["load_model_shared", "map_safetensors", "read_safetensors_header",
           "aligned_file", "aligned_dir", "write_aligned_copy", "ALIGN", "MappedWeights"]

log = logging.getLogger(__name__)

#: byte alignment of every tensor in a rewritten file (a cache line)
ALIGN = 64
#: bytes copied per read when a file is rewritten aligned
_COPY_CHUNK = 64 << 20
#: the largest safetensors header we read (the format's own limit is 100 MB)
_MAX_HEADER = 100 << 20

#: safetensors dtype name -> MLX dtype
DTYPES = {"BOOL": mx.bool_, "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16,
          "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64,
          "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32, "F64": mx.float64,
          "C64": mx.complex64}


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: bytes [start, end) of the file."""
    name: str
    dtype: str          # safetensors' name, a key of DTYPES
    shape: tuple
    start: int
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].size


@dataclass
class MappedWeights:
    """What :func:`map_safetensors` gives: the arrays by name, and how many
    bytes are views of the file mapping (shared) or private copies."""
    arrays: dict
    shared_bytes: int = 0
    private_bytes: int = 0
    path: str = ""


def read_safetensors_header(path) -> tuple[dict, list[Tensor]]:
    """(metadata, tensors in file order) of the safetensors file at ``path``.
    Raises ValueError, naming the file, for anything malformed or a dtype
    outside DTYPES; OSError where it cannot be read."""
    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    tensors = []
    for name, t in header.items():
        try:
            dtype, shape, (lo, hi) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} lacks dtype, shape or data_offsets") from None
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype!r}, which MLX cannot map")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {list(shape)}")
        nbytes = math.prod(shape) * DTYPES[dtype].size
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo and hi - lo == nbytes
                and data_start + hi <= size):
            raise ValueError(f"{path}: tensor {name!r} has data_offsets [{lo}, {hi}], "
                             f"not {nbytes} bytes inside the file")
        tensors.append(Tensor(name, dtype, shape, data_start + lo, data_start + hi))
    tensors.sort(key=lambda t: t.start)
    return metadata, tensors


def _is_aligned(tensors) -> bool:
    return all(t.start % t.itemsize == 0 for t in tensors)


def aligned_dir() -> Path:
    """Where rewritten (aligned) weight files go: ``$SHMCACHE_WEIGHTS_DIR``, else
    ``$XDG_CACHE_HOME/shmcache/aligned-weights`` (``~/.cache`` without it)."""
    if d := os.environ.get("SHMCACHE_WEIGHTS_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shmcache" / "aligned-weights"


def _write_aligned(src: str, metadata: dict, tensors: list, dst: Path) -> None:
    """Write a safetensors file at ``dst`` with the same tensors as ``src``,
    each at a multiple of ALIGN (the header padded with spaces, as the format allows)."""
    offsets, at = {}, 0
    for t in tensors:
        at = -(-at // ALIGN) * ALIGN
        offsets[t.name] = (at, at + t.end - t.start)
        at += t.end - t.start
    header = {"__metadata__": metadata} if metadata else {}
    header.update({t.name: {"dtype": t.dtype, "shape": list(t.shape),
                            "data_offsets": list(offsets[t.name])} for t in tensors})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            fout.write(struct.pack("<Q", len(text)) + text)
            base = 8 + len(text)
            for t in tensors:
                fout.seek(base + offsets[t.name][0])
                fin.seek(t.start)
                left = t.end - t.start
                while left:
                    chunk = fin.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise ValueError(f"{src}: ended inside tensor {t.name!r}")
                    fout.write(chunk)
                    left -= len(chunk)
            fout.truncate(base + at)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()


def _version(st: os.stat_result) -> str:
    """The key of one state of a source file (its size, mtime, inode) and of ALIGN."""
    return hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{ALIGN}".encode()).hexdigest()[:16]


def _drop_stale(cache_dir: Path) -> None:
    """Remove the aligned copies whose source file is gone or has changed since.
    Each copy ``<source>-<version>.safetensors`` has a ``<source>.json`` naming
    its source path and version. Called under the directory's lock."""
    for note in cache_dir.glob("*.json"):
        try:
            rec = json.loads(note.read_text())
            st = os.stat(rec["source"])
            if _version(st) == rec["version"]:
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass                                # gone, or a note we cannot read
        for old in cache_dir.glob(f"{note.stem}-*.safetensors"):
            old.unlink(missing_ok=True)
        note.unlink(missing_ok=True)


def write_aligned_copy(src, dst) -> None:
    """Write at ``dst`` a safetensors file with ``src``'s tensors and metadata,
    each tensor at a multiple of ALIGN (replaced atomically)."""
    metadata, tensors = read_safetensors_header(src)
    _write_aligned(str(src), metadata, tensors, Path(dst))


def aligned_file(path, cache_dir=None) -> Path:
    """``path`` itself where every tensor of it is at a multiple of its item
    size; else its aligned copy under ``cache_dir`` (default :func:`aligned_dir`),
    written here first if no process has yet (one writer at a time: the
    directory's ``.lock``). Each write first removes the copies whose source
    is gone or has changed."""
    path = Path(path)
    metadata, tensors = read_safetensors_header(path)
    if _is_aligned(tensors):
        return path
    cache_dir = Path(cache_dir) if cache_dir is not None else aligned_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    st = os.stat(path)
    real = os.path.realpath(path)
    source, version = hashlib.sha256(real.encode()).hexdigest()[:16], _version(st)
    dst = cache_dir / f"{source}-{version}.safetensors"
    if dst.exists():
        return dst
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # one writer; the others wait, then reuse
        if not dst.exists():
            _drop_stale(cache_dir)
            free = shutil.disk_usage(cache_dir).free
            if free < st.st_size + (64 << 20):
                raise OSError(f"{cache_dir}: {free} bytes free, too few for an aligned copy "
                              f"of {path} ({st.st_size} bytes)")
            log.info("weights: %s is not aligned for mapping; writing an aligned copy to %s",
                     path, dst)
            _write_aligned(str(path), metadata, tensors, dst)
            (cache_dir / f"{source}.json").write_text(
                json.dumps({"source": real, "version": version}) + "\n")
    return dst


def _native():
    """shmcache._mlxbuf where its map_file is usable here, else (None, why not)."""
    if os.environ.get("SHMCACHE_PURE"):
        return None, "SHMCACHE_PURE is set"
    try:
        from shmcache import _mlxbuf
    except ImportError as e:
        return None, f"shmcache._mlxbuf is not built ({e})"
    if getattr(_mlxbuf, "MLX_VERSION", None) != mx.__version__:
        return None, (f"shmcache._mlxbuf was built for MLX {getattr(_mlxbuf, 'MLX_VERSION', '?')}, "
                      f"this is {mx.__version__}")
    if not hasattr(_mlxbuf, "map_file"):
        return None, "shmcache._mlxbuf has no map_file (an older build)"
    return _mlxbuf, ""


def map_safetensors(path, cache_dir=None) -> MappedWeights:
    """The tensors of the safetensors file at ``path`` as MLX arrays over one
    read-only shared mapping of it (of its aligned copy where it is not
    aligned, see :func:`aligned_file`). Raises RuntimeError where
    ``shmcache._mlxbuf`` cannot map here."""
    native, why = _native()
    if native is None:
        raise RuntimeError(why)
    mapped = aligned_file(path, cache_dir)
    _, tensors = read_safetensors_header(mapped)
    out = native.map_file(str(mapped), [(t.start, list(t.shape), DTYPES[t.dtype]) for t in tensors])
    res = MappedWeights({}, path=str(mapped))
    for t, (arr, shared) in zip(tensors, out):
        res.arrays[t.name] = arr
        if shared:
            res.shared_bytes += t.end - t.start
        else:
            res.private_bytes += t.end - t.start
    return res


def _why_not_shared(config: dict, model_path: Path) -> str:
    """Why this model takes mlx_lm.load's path, or "" where ours covers it."""
    if config.get("model_file") is not None:
        return f"its config names a model_file ({config['model_file']!r})"
    if config.get("quantization") is None:
        legacy = config.get("quantization_config") or config.get("text_config", {}).get(
            "quantization_config")
        if legacy or (model_path / "hf_quant_config.json").exists():
            return "it is quantized in a format mlx_lm converts at load (quantization_config)"
    if config.get("quantize_activations", False):
        return "it quantizes activations"
    _, why = _native()
    return why


def _build_model(model_path: Path, config: dict, weights: dict):
    """mlx_lm.utils.load_model's steps for a config it loads as is: the model
    class, sanitize, quantization (config["quantization"] with its per-layer
    entries), eval mode, load_weights (strict)."""
    from mlx_lm.utils import _get_classes, _takes_global_scale, infer_quant_config

    model_class, model_args_class = _get_classes(config=config)
    model = model_class(model_args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if (quantization := config.get("quantization")) is not None:
        def class_predicate(p, m):
            if p in quantization:               # a per-layer entry
                return quantization[p]
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            params = infer_quant_config(p, m, weights)
            if f"{p}.global_scale" in weights and _takes_global_scale(m):
                params["global_scale"] = True
            return params

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=class_predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def load_model_shared(model_dir, cache_dir=None):
    """(model, tokenizer) as ``mlx_lm.load(model_dir)`` gives them, with the
    weights over a read-only mapping shared by every process that loads the
    same files (see the module docstring). ``cache_dir``: where an aligned copy
    is written when the files need one (default :func:`aligned_dir`). Falls
    back to ``mlx_lm.load`` where this path does not apply, logging why."""
    from mlx_lm.utils import _download, load_config, load_tokenizer

    model_path = _download(str(model_dir))
    config = load_config(model_path)
    if "quantization_config" not in config and "quantization_config" in config.get("text_config", {}):
        config["quantization_config"] = config["text_config"]["quantization_config"]
    why = _why_not_shared(config, model_path)
    weight_files = sorted(glob.glob(str(model_path / "model*.safetensors")))
    if not why and not weight_files:
        raise FileNotFoundError(f"No safetensors found in {model_path}")
    weights, shared, private = {}, 0, 0
    if not why:
        try:
            for wf in weight_files:
                m = map_safetensors(wf, cache_dir)
                weights.update(m.arrays)
                shared, private = shared + m.shared_bytes, private + m.private_bytes
        except (ValueError, OSError, RuntimeError) as e:
            why = f"its weights cannot be mapped ({e})"
    if why:
        log.warning("weights: %s loads a private copy of its weights (mlx_lm.load): %s",
                    model_path, why)
        from mlx_lm import load
        return load(str(model_dir))
    model = _build_model(model_path, config, weights)
    log.info("weights: %s: %.1f MB mapped shared, %.1f MB private copies", model_path,
             shared / 1e6, private / 1e6)
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer

"""Who may share an L2 entry: the model's identity and the secret.

Two pools share an entry only when the key is the same, that is when their
model identity, their layout (``codec.fingerprint``) and their secret agree:

* :func:`model_identity`: the model's name plus a digest of what makes its
  K/V (config, weights, MLX version, CPU architecture), so two different
  checkpoints under one name never share;
* :func:`resolve_secret`: the cluster secret when one is configured (an
  argument or ``$SHMCACHE_CLUSTER_SECRET``), else one derived from the pool's
  own random hash seed: the processes of that pool share their entries (Redis
  as a larger cache of one host) and nobody else can.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Optional, Union

SECRET_ENV = "SHMCACHE_CLUSTER_SECRET"


def runtime_identity() -> str:
    """What else decides the K/V's bits: the MLX version and the CPU
    architecture (hosts must compute bit-identical K/V to share them)."""
    try:
        from importlib.metadata import version
        mlx = version("mlx")
    except Exception:
        mlx = "?"
    return f"mlx-{mlx}-{platform.machine()}"


def model_identity(path, runtime: Optional[str] = None) -> str:
    """The model's name plus a digest of what makes its K/V.

    The digest covers config.json, the weight files (name, size, first and
    last MiB of each) and the runtime (:func:`runtime_identity`, unless
    given). Cheap (a few MiB read); two different checkpoints under one name
    differ in it.

    Args:
        path: the mlx-lm model directory.
        runtime: the runtime identity to use instead of this host's.
    Returns:
        ``"<directory name>@<24 hex digits>"``.
    """
    path = Path(path)
    h = hashlib.blake2b(digest_size=12, person=b"shmcache-model")
    h.update((runtime if runtime is not None else runtime_identity()).encode() + b"\x00")
    cfg = path / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.npz")):
        size = f.stat().st_size
        h.update(f"\x00{f.name}\x00{size}\x00".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return f"{path.name}@{h.hexdigest()}"


def resolve_model(model: Union[str, os.PathLike]) -> str:
    """A model identity from a model directory (:func:`model_identity`) or
    an identity string taken as it is."""
    if isinstance(model, os.PathLike) or (isinstance(model, str) and os.path.isdir(model)):
        return model_identity(model)
    if not isinstance(model, str) or not model:
        raise ValueError(f"l2_model must be a model directory or a non-empty identity, "
                         f"not {model!r}")
    return model


def resolve_secret(cluster_secret: Union[str, bytes, None], pool_seed: bytes) -> bytes:
    """The L2 secret of one pool.

    Args:
        cluster_secret: the secret shared by the pools that share entries;
            None: ``$SHMCACHE_CLUSTER_SECRET`` if set, else the pool's own.
        pool_seed: the pool's random hash seed (``Pool.seed``), readable only
            by the processes that may attach to it.
    Returns:
        The secret's bytes.
    Raises:
        ValueError: an empty secret.
    """
    if cluster_secret is None:
        cluster_secret = os.environ.get(SECRET_ENV) or None
    if cluster_secret is None:
        # (personalised: the pool's own prefix index hashes from the seed too)
        return hashlib.blake2b(pool_seed, digest_size=32, person=b"shmcache-l2-pool").digest()
    s = cluster_secret.encode() if isinstance(cluster_secret, str) else bytes(cluster_secret)
    if not s:
        raise ValueError("the cluster secret must not be empty")
    return s

"""``shmcache doctor``: what this machine gives a shmcache worker.

The BLAS library MLX's CPU matmuls go to and its thread count, a measured
1024^3 float32 matmul, the mlx and mlx-lm versions, /dev/shm's size and free
space, and the CPU count. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

from .system import blas
from .shm import segment

MATMUL_N = 1024


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _shm(path: str) -> dict:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return {"path": path, "size_bytes": None, "free_bytes": None, "error": str(e)}
    return {"path": path, "size_bytes": st.f_blocks * st.f_frsize,
            "free_bytes": st.f_bavail * st.f_frsize}


def collect(measure: bool = True, n: int = MATMUL_N) -> dict:
    """Everything the doctor reports, as one JSON-able dict."""
    d: dict = {}
    gflops, err = None, None
    if measure:
        try:
            gflops = blas.matmul_gflops(n)
        except Exception as e:  # noqa: BLE001 - report it, the doctor exits 0
            err = f"{type(e).__name__}: {e}"
    d["blas"] = blas.info().as_dict()            # after the matmul: mlx is loaded
    d["matmul_gflops"] = None if gflops is None else round(gflops, 2)
    d["matmul_size"] = n
    if err:
        d["matmul_error"] = err
    d["mlx_version"] = _version("mlx")
    d["mlx_lm_version"] = _version("mlx-lm")
    d["shm"] = _shm(segment.SHM_DIR)
    d["cpu_count"] = os.cpu_count()
    try:
        d["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        d["cpus_usable"] = d["cpu_count"]
    d["python"] = platform.python_version()
    d["platform"] = f"{platform.system()} {platform.machine()}"
    d["warnings"] = warnings(d)
    return d


SMALL_SHM_BYTES = 256 << 20      # below this, /dev/shm is called small (Docker's default: 64 MiB)


def warnings(d: dict) -> list:
    """What the report shows that will hurt ``shmcache serve``, one sentence each."""
    out = []
    size = d["shm"].get("size_bytes")
    if size is not None and size < SMALL_SHM_BYTES:
        out.append(f"/dev/shm is small ({size / 2**20:.0f} MiB; Docker's default is 64 MiB): "
                   f"the default pool shrinks to half its free space; give it more room "
                   f"(docker run --shm-size=1g) or set the pool size with --max-blocks")
    elif size is None:
        out.append(f"/dev/shm cannot be read: {d['shm'].get('error')}")
    return out


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def render(d: dict) -> str:
    b = d["blas"]
    th = b["threads"]
    lines = [
        f"blas      {b['name']}  {b['path'] or '-'}",
        f"          {'?' if th is None else th} thread{'' if th == 1 else 's'}, "
        f"{'optimized' if b['optimized'] else 'NOT optimized'}, "
        f"{'bound in libmlx' if b['bound'] else 'not verified in libmlx'}"
        + (f"; {b['detail']}" if b["detail"] else ""),
    ]
    if d["matmul_gflops"] is not None:
        n = d["matmul_size"]
        lines.append(f"matmul    {d['matmul_gflops']:.1f} GFLOP/s ({n}x{n}x{n} float32, MLX CPU)")
    elif d.get("matmul_error"):
        lines.append(f"matmul    failed: {d.get('matmul_error')}")
    else:
        lines.append("matmul    not measured")
    lines += [
        f"mlx       {d['mlx_version'] or 'not installed'}, "
        f"mlx-lm {d['mlx_lm_version'] or 'not installed'}",
        f"shm       {d['shm']['path']}: size {_gib(d['shm']['size_bytes'])}, "
        f"free {_gib(d['shm']['free_bytes'])}",
        f"cpus      {d['cpu_count']} ({d['cpus_usable']} usable by this process)",
        f"python    {d['python']} on {d['platform']}",
    ]
    disabled = "SHMCACHE_BLAS" in (b["detail"] or "")
    lines += [f"warning   {w}" for w in d.get("warnings", ())]
    if sys.platform.startswith("linux") and not b["optimized"] and not disabled:
        lines.append("hint      MLX uses the reference BLAS (slow matmuls): install an optimized "
                     "one (Debian: apt-get install libopenblas0-pthread) and import shmcache "
                     "before mlx")
    return "\n".join(lines)


def run(as_json: bool = False, measure: bool = True) -> int:
    d = collect(measure=measure)
    print(json.dumps(d, indent=2) if as_json else render(d))
    return 0

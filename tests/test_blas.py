"""shmcache.system.blas: an optimized CBLAS bound under MLX, checked in fresh processes.

The BLAS binding happens once per process, when libmlx is loaded, so every
case runs in its own interpreter. The speed check is what fails if the
binding broke: MLX on its reference BLAS does 1-6 GFLOP/s on a 1024^3 float32
matmul, on OpenBLAS (one thread) 50-100.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmcache.system import blas

ROOT = Path(__file__).resolve().parent.parent
MIN_GFLOPS = 15.0
TIMEOUT = 120

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the CBLAS swap is for Linux (macOS uses Accelerate)")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHMCACHE_BLAS", "SHMCACHE_BLAS_THREADS", "LD_PRELOAD",
                        "OPENBLAS_THREAD_TIMEOUT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(code: str, **extra) -> dict:
    """Run code in a fresh interpreter; it prints one JSON line last."""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(**extra),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


PROBE = """
import json, shmcache
import mlx.core
from shmcache.system import blas
i = blas.info()
print(json.dumps({"info": i.as_dict(), "gflops": blas.matmul_gflops(1024, repeats=%d)}))
"""


def _need_optimized() -> list[str]:
    found = blas.candidates()
    if not found:
        pytest.skip("no optimized CBLAS installed here (Debian: apt-get install "
                    "libopenblas0-pthread)")
    return found


def test_import_shmcache_binds_the_optimized_blas():
    found = _need_optimized()
    out = _run(PROBE % 5)
    i = out["info"]
    assert i["optimized"] and i["name"] != "reference", i
    assert i["bound"], i                      # read from libmlx's own relocation
    assert os.path.realpath(i["path"]) in {os.path.realpath(p) for p in found}, i
    assert i["threads"] == 1, i               # one thread per worker process by default
    assert out["gflops"] > MIN_GFLOPS, (out["gflops"], i)


def test_off_keeps_the_reference_blas():
    out = _run(PROBE % 1, SHMCACHE_BLAS="off")
    i = out["info"]
    assert i["name"] == "reference" and not i["optimized"] and i["bound"], i
    assert "mlx_cpu.libs" in i["path"], i
    assert "SHMCACHE_BLAS=off" in i["detail"]


def test_mlx_imported_first_is_too_late_and_warns():
    _need_optimized()
    out = _run("import json, mlx.core, shmcache\n"
               "print(json.dumps(shmcache.system.blas.info().as_dict()))")
    assert out["name"] == "reference" and out["bound"], out
    assert "too late" in out["detail"] and "too late" in out["stderr"]


def test_explicit_library_and_threads():
    found = _need_optimized()
    out = _run(PROBE % 1, SHMCACHE_BLAS=found[-1], SHMCACHE_BLAS_THREADS="2")
    i = out["info"]
    assert os.path.realpath(i["path"]) == os.path.realpath(found[-1]), i
    assert i["optimized"] and i["bound"], i
    if i["name"] in ("openblas", "blis", "mkl"):
        assert i["threads"] == 2, i


SPIN_PROBE = """
import json, time, shmcache
import mlx.core as mx
from shmcache.system import blas
a = mx.random.normal((384, 384))
for _ in range(5):
    mx.eval(a @ a)
t0 = time.process_time()
time.sleep(0.3)
print(json.dumps({"idle_cpu_s": time.process_time() - t0, "name": blas.info().name}))
"""


def test_the_workers_spin_setting_puts_openblas_threads_to_sleep_at_once():
    """OpenBLAS's threads spin about 0.1 s after a product by default (here:
    0.10 s of CPU in a 0.3 s sleep, with 2 threads); with the setting the
    supervisor gives its workers they sleep at once, leaving the cores to
    the other workers. Fails if OpenBLAS ignored it, or the name changed."""
    from workers.supervisor.worker_procs import BLAS_SPIN, BLAS_SPIN_ENV
    _need_optimized()
    out = _run(SPIN_PROBE, SHMCACHE_BLAS_THREADS="2", **{BLAS_SPIN_ENV: BLAS_SPIN})
    if out["name"] != "openblas":
        pytest.skip(f"the spin setting is OpenBLAS's; the BLAS bound here is {out['name']}")
    assert out["idle_cpu_s"] < 0.03, out


def test_a_missing_library_warns_and_falls_back():
    out = _run(PROBE % 1, SHMCACHE_BLAS="/nonexistent/libopenblas.so.0")
    assert out["info"]["name"] == "reference", out
    assert "could not load" in out["stderr"]


def test_blas_module_does_not_import_mlx_and_predicts_the_binding():
    found = _need_optimized()
    code = f"""
import json, sys, types
# shmcache.system.blas and the modules it imports, without shmcache/__init__.py (which
# would call use_fast_blas itself): this test says so, a bare package object
# with the real package's path stands in for it
pkg = types.ModuleType("shmcache"); pkg.__path__ = [{str(ROOT / "shmcache")!r}]
sys.modules["shmcache"] = pkg
import shmcache.system.blas as b
assert "mlx.core" not in sys.modules
before = b.use_fast_blas().as_dict()
assert "mlx.core" not in sys.modules
import mlx.core
print(json.dumps({{"before": before, "after": b.info().as_dict()}}))
"""
    out = _run(code)
    assert out["before"]["path"] == os.path.normpath(found[0]) and not out["before"]["bound"]
    assert out["after"]["path"] == out["before"]["path"] and out["after"]["bound"]


def test_doctor_json():
    r = subprocess.run([sys.executable, "-m", "shmcache.cli", "doctor", "--json"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert {"blas", "matmul_gflops", "matmul_size", "mlx_version", "mlx_lm_version", "shm",
            "cpu_count", "cpus_usable", "python", "platform"} <= set(d)
    assert {"path", "name", "threads", "optimized", "bound", "detail"} <= set(d["blas"])
    assert {"path", "size_bytes", "free_bytes"} <= set(d["shm"])
    assert d["matmul_size"] == 1024 and d["matmul_gflops"] > 0
    assert d["shm"]["size_bytes"] >= d["shm"]["free_bytes"] >= 0
    assert d["cpu_count"] >= 1 and d["mlx_version"]
    if blas.candidates():
        assert d["blas"]["optimized"] and d["matmul_gflops"] > MIN_GFLOPS, d


def test_doctor_text():
    r = subprocess.run([sys.executable, "-m", "shmcache.cli", "doctor"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    for word in ("blas", "GFLOP/s", "mlx", "/dev/shm", "cpus"):
        assert word in r.stdout

#!/usr/bin/env bash
# The 16-core benchmark of issue 26 on the device machine (Python 3.12 with
# numpy, no network): installs what .whl/ carries (tools/fetch_device_wheels.sh
# fills it here), builds shmcache there, and runs tools.bench.serve on the
# realistic model (Qwen2.5-0.5B's shape, 24 layers) with 8 workers / servers.
#
#   bash tools/device_bench.sh setup               # install + build (idempotent)
#   bash tools/device_bench.sh chat [ARGS...]      # one workload, 2 rounds
#   bash tools/device_bench.sh unique | shared     # the others
#   bash tools/device_bench.sh all [ARGS...]       # the three in one command
#
# Every command runs setup first when it has not run on this machine. ARGS go
# to tools.bench.serve (e.g. --rounds 3, --model realistic:12). The JSON goes
# to $OUT (the device's return folder) when set, else to the current folder.
# One workload of 2 rounds over a, b, c (and c-sticky for chat) is sized to
# stay within a 10-minute command; "all" may not.
#
# Environment: VENV (default /tmp/shmcache-bench-venv), WORKERS (8), ROUNDS (2),
# STEP_LOGS=1: every worker's step log (SHMCACHE_STEP_TIMING) packed into one
# $OUT/steps-WORKLOAD.tar.gz (the device returns only a few files a call); read
# them with python -m tools.bench.step_logs DIR (steps by rows and BLAS threads).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV=${VENV:-/tmp/shmcache-bench-venv}
WORKERS=${WORKERS:-8}
ROUNDS=${ROUNDS:-2}
WHL="$ROOT/.whl"
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
SYS_PY=${SYS_PY:-python3}

say() { echo "[device_bench] $*" >&2; }

setup() {
  local t0=$SECONDS
  [ -d "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1 || {
    say "no wheels in $WHL: run tools/fetch_device_wheels.sh where there is a network, and carry .whl"
    exit 1; }
  # the compiler that `pip install -e .` needs for shmcache._hot (required on Linux)
  if command -v g++ >/dev/null 2>&1; then
    say "compiler: $(command -v g++) ($(g++ -dumpfullversion 2>/dev/null || g++ -dumpversion))"
  else
    say "no g++ on this machine: shmcache's C++ extensions cannot be built here (carry a" \
        "cp312 wheel of shmcache built elsewhere instead)"
    exit 1
  fi
  # Debian's OpenBLAS (pthread variant), the BLAS every configuration runs on; its
  # runtime libraries only where the system has none (never over newer ones)
  if [ ! -e "$OPENBLAS" ]; then
    dpkg -x "$WHL"/libopenblas0-pthread_*.deb /
    say "unpacked $(basename "$WHL"/libopenblas0-pthread_*.deb) into /"
  else
    say "$OPENBLAS already there: kept"
  fi
  for lib in gfortran:libgfortran.so.5:libgfortran5 quadmath:libquadmath.so.0:libquadmath0; do
    IFS=: read -r _ so deb <<<"$lib"
    if ldconfig -p | grep "$so " >/dev/null; then     # not grep -q: pipefail and SIGPIPE
      say "$so: the system's ($(ldconfig -p | grep "$so " | head -1 | sed 's/.*=> //')) kept"
    else
      dpkg -x "$WHL"/${deb}_*.deb /
      say "unpacked $(basename "$WHL"/${deb}_*.deb) into /"
    fi
  done
  ldconfig
  # a venv of our own; the system's numpy is made visible to it (numpy is not carried)
  if [ ! -x "$VENV/bin/python" ]; then
    "$SYS_PY" -m venv "$VENV"
  fi
  local site np_dir link_dir
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  np_dir=$("$SYS_PY" -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
  link_dir="$VENV/system-numpy"
  mkdir -p "$link_dir"
  for p in "$np_dir"/numpy "$np_dir"/numpy.libs "$np_dir"/numpy-*.dist-info; do
    [ -e "$p" ] && ln -sfn "$p" "$link_dir/$(basename "$p")"
  done
  echo "$link_dir" > "$site/system-numpy.pth"
  "$VENV/bin/python" -m pip install --quiet --no-index --no-deps "$WHL"/*.whl
  # setuptools >= 7x refuses setup.py's absolute source path (nanobind's
  # nb_combined.cpp) when it writes an editable install's manifest; the
  # benchmark runs from $ROOT and needs only the C extensions beside the sources
  if ! "$VENV/bin/python" -m pip install --quiet --no-build-isolation --no-deps -e "$ROOT" \
       >"$VENV/pip-install-e.log" 2>&1; then
    say "pip install -e failed ($(grep -m1 -o 'setup script specifies an absolute path' \
        "$VENV/pip-install-e.log" || echo "see $VENV/pip-install-e.log")): building in place"
  fi
  if ! (cd "$ROOT" && "$VENV/bin/python" -c "import shmcache._hot") 2>/dev/null; then
    (cd "$ROOT" && "$VENV/bin/python" setup.py -q build_ext --inplace)
  fi
  (cd "$ROOT" && "$VENV/bin/python" - <<'PY'
import shmcache, shmcache._hot          # first: it binds the OpenBLAS before mlx loads
import shmcache.system.blas as blas
import numpy, mlx.core as mx, mlx_lm, transformers, fastapi, uvicorn, httpx, psutil, msgspec
i = blas.info()
print(f"[device_bench] ok: numpy {numpy.__version__}, mlx {mx.__version__}, "
      f"BLAS {i.name} ({i.path}), threads {i.threads}", flush=True)
try:
    import shmcache._mlxbuf  # noqa: F401
except ImportError as e:
    print(f"[device_bench] note: shmcache._mlxbuf not built ({e})", flush=True)
PY
  )
  # the realistic model (1.4 GB of float32), built once here, not inside a timed command
  # (BUILD_MODEL=0: not now)
  [ "${BUILD_MODEL:-1}" = 0 ] || \
  (cd "$ROOT" && "$VENV/bin/python" -c "from tools.bench.serve_models import resolve; print('[device_bench] model', resolve('realistic')[0])")
  touch "$VENV/.setup-done"
  say "setup done in $((SECONDS - t0)) s"
}

bench() {
  local workload=$1; shift
  local extra=()
  case "$workload" in
    chat)   extra=(--sessions "$WORKERS" --turns 3 --chat-system-chars 200 --user-chars 40-80) ;;
    unique) extra=(--requests 16 --concurrency "$WORKERS" --system-chars 200) ;;
    shared) extra=(--requests 16 --concurrency "$WORKERS" --system-chars 400) ;;
    all)    extra=(--sessions "$WORKERS" --turns 3 --chat-system-chars 200 --user-chars 40-80
                   --requests 16 --concurrency "$WORKERS" --system-chars 300)
            workload=chat,unique,shared ;;
  esac
  local out="${OUT:-.}/bench-${workload//,/-}.json"
  say "cores $(nproc); load $(cut -d' ' -f1-3 /proc/loadavg); workload $workload"
  local steps=""
  if [ "${STEP_LOGS:-0}" = 1 ]; then
    steps=$(mktemp -d /tmp/shmcache-steps.XXXXXX)
    export SHMCACHE_STEP_TIMING="$steps"
  fi
  local rc=0
  "$VENV/bin/python" -m tools.bench.serve --model realistic --workers "$WORKERS" \
    --rounds "$ROUNDS" --workloads "$workload" --max-tokens 16 --startup-timeout 600 \
    "${extra[@]}" --json "$out" "$@" || rc=$?
  say "figures in $out"
  if [ -n "$steps" ]; then
    tar -czf "${OUT:-.}/steps-${workload//,/-}.tar.gz" -C "$steps" .
    rm -rf "$steps"
    say "step logs in ${OUT:-.}/steps-${workload//,/-}.tar.gz (one engine-PID.log per worker)"
  fi
  return "$rc"
}

cmd=${1:-all}; shift || true
case "$cmd" in
  setup) setup ;;
  chat|unique|shared|all)
    if ! [ -f "$VENV/.setup-done" ] || \
       ! (cd "$ROOT" && "$VENV/bin/python" -c "import shmcache._hot") 2>/dev/null; then
      setup
    fi
    bench "$cmd" "$@" ;;
  *) say "unknown command $cmd: setup, chat, unique, shared or all"; exit 2 ;;
esac

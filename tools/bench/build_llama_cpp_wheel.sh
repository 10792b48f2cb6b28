#!/usr/bin/env bash
# Build llama-cpp-python's wheel once and cache it (it is not a dependency of
# shmcache: tools.bench_serve's llama configuration and tools.bench.llama_agreement
# use it where it is installed). Building from the sdist takes about 12 minutes
# on 2 cores (30 with the examples and tools, which are switched off here).
#
#   bash tools/bench/build_llama_cpp_wheel.sh            # build (or reuse) the wheel
#   bash tools/bench/build_llama_cpp_wheel.sh install    # and install it into .venv
#
# The wheel goes to ${SHMCACHE_WHEELS:-~/.cache/shmcache/wheels}. It is built
# for this machine's CPU (llama.cpp's GGML_NATIVE); carry it only to the same kind.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
WHEELS=${SHMCACHE_WHEELS:-$HOME/.cache/shmcache/wheels}
PY=${PY:-$ROOT/.venv/bin/python}
mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "building llama-cpp-python $VERSION (about 12 minutes on 2 cores) into $WHEELS" >&2
  CMAKE_ARGS="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$PY" -m pip wheel --no-deps -w "$WHEELS" "llama-cpp-python==$VERSION"
  wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -1)
else
  echo "cached: $wheel" >&2
fi
if [ "${1:-}" = install ]; then
  # the server's own dependencies; the rest (numpy, jinja2, fastapi, uvicorn,
  # pydantic) are shmcache's already
  "$PY" -m pip install -q --no-deps "$wheel" diskcache sse-starlette starlette-context \
    pydantic-settings python-dotenv
  echo "installed $(basename "$wheel") into $("$PY" -c 'import sys; print(sys.prefix)')" >&2
fi

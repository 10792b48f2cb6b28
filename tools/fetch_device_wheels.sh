#!/usr/bin/env bash
# Fill .whl/ (gitignored) with what tools/device_bench.sh installs on the 16-core
# benchmark machine, which has Python 3.12 and numpy but no network: the wheels
# of shmcache's serving stack for CPython 3.12 on manylinux x86-64 (numpy left
# out: the machine has its own), the build requirements of `pip install -e .`
# (setuptools, nanobind, mlx's headers), and Debian's OpenBLAS .debs.
#
#   bash tools/fetch_device_wheels.sh          # then carry .whl to the machine
#
# Versions are pinned to the ones this project is developed and tested with.
# Fails if the result is over 60 MiB (what one carry to the machine may hold).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY=${PY:-python3}
mkdir -p "$DEST"
PKGS=(
  mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 transformers==5.25.0 tokenizers==0.23.3
  safetensors==0.8.0 huggingface_hub==2.4.0 jinja2==3.1.6 fastapi==0.165.0 starlette==1.10.0
  pydantic==2.14.4 pydantic_core==2.50.5 uvicorn==0.55.0 h11==0.16.0 anyio==4.16.0
  click==8.5.1 httpx==0.29.0 httpcore==1.0.9 openai==3.63.0 prometheus-client==0.26.0
  redis==8.2.0 msgspec==0.23.0 psutil==7.2.2 nanobind==3.1.0 regex==2026.12.2 pyyaml==6.0.4
  tqdm==4.70.1 filelock==4.3.2 fsspec==2026.9.0 packaging==26.4 protobuf==7.36.2
  typing-extensions==4.16.0
  setuptools   # the build backend of `pip install --no-build-isolation -e .`
)
# The machine's glibc is 2.39 (Ubuntu 24.04). Older pips match --platform
# literally (no expansion to older manylinux tags), so every tag a wheel we
# need carries is listed.
PLATFORMS=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux_2_12 manylinux_2_5 manylinux2014 \
           manylinux2010 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download --quiet --dest "$DEST" --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" --platform any "${PKGS[@]}" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
test "${PIPESTATUS[0]}" -eq 0
# the machine has its own numpy (2.5.x); ours would only replace it
rm -f "$DEST"/numpy-*.whl

# Debian's OpenBLAS (pthread variant) and the runtime libraries it links
if command -v apt-get >/dev/null; then
  ( cd "$DEST" && apt-get download libopenblas0-pthread libgfortran5 libquadmath0 >/dev/null ) || {
    echo "fetch_device_wheels: apt-get download failed (run 'apt-get update' first?)" >&2; exit 1; }
else
  echo "fetch_device_wheels: no apt-get here: the OpenBLAS .debs are missing" >&2; exit 1
fi

size_kib=$(du -sk "$DEST" | cut -f1)
echo "fetch_device_wheels: $(ls "$DEST" | wc -l) files, $((size_kib / 1024)) MiB in $DEST"
ls "$DEST"
if [ "$size_kib" -gt $((60 * 1024)) ]; then
  echo "fetch_device_wheels: $DEST is over 60 MiB" >&2
  exit 1
fi

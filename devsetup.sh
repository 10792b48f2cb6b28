#!/bin/bash
# device machine setup (not part of the repo): python 3.12 venv + carried wheels + /opt/torch's numpy
set -e
export PYTHONPATH=$PWD
if [ ! -f .venv/.ok ]; then
  for d in .whl/*.deb; do dpkg -x "$d" /; done; ldconfig
  rm -rf .venv; /usr/bin/python3 -m venv .venv
  echo /opt/torch/.venv/lib/python3.12/site-packages > .venv/lib/python3.12/site-packages/zz_torch_numpy.pth
  .venv/bin/pip install -q --no-index --no-deps .whl/*.whl
  .venv/bin/python setup.py -q build_ext --inplace 2>&1 | grep -v -i warning | tail -3
  touch .venv/.ok
fi
.venv/bin/python -c "import shmcache, mlx.core as mx, mlx_lm, numpy; print('ok', mx.__version__, numpy.__version__); from shmcache import blas; print(blas.info())"

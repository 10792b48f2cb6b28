PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test run bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py shmcache/_hot.c shmcache/_hot_mutex.h shmcache/_gather.c shmcache/_gather.h shmcache/_gather_pool.h shmcache/_mlxbuf.cpp
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q
	# the fallback where the C accelerators are not built: same mutex, Python paths, numpy gather
	SHMCACHE_PURE=1 $(BIN)/python -m pytest -q tests/test_mutex.py tests/test_recovery.py \
		tests/test_paged_cache.py tests/test_lock.py tests/test_kv.py

run: setup
	$(BIN)/python -m workers.supervisor

bench: setup
	$(BIN)/pip install -q --no-deps vllm-mlx==0.6.0
	$(BIN)/python -m tools.bench

clean:
	rm -rf $(VENV) build *.egg-info shmcache/*.so

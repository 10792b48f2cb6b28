PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test run bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

run: setup
	$(BIN)/python -m workers.supervisor

bench: setup
	$(BIN)/pip install -q --no-deps vllm-mlx==0.6.0
	$(BIN)/python -m tools.bench

clean:
	rm -rf $(VENV) build *.egg-info

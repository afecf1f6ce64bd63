# Two entry points: `make demo` and `make test`. Each builds its own venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean sysdeps vocab

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first, pinned, from the local wheel: never a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	# llama.cpp compiles from source here (no wheels on PyPI); pip's wheel cache makes it fast after the first build.
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/pip install --quiet -e '.[test,report,llamacpp]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvmesh demo

# Headless Chromium for the console's browser test: installed only when missing and we are root;
# never fails the build (without it that one test skips and says why).
sysdeps:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
			|| echo "sysdeps: could not install chromium; the browser test will skip"; \
	fi

# The code stays lint-clean: ruff (rules in pyproject.toml) and mypy over the kvmesh package.
lint: $(STAMP)
	$(BIN)/ruff check node console kvmesh
	$(BIN)/mypy -p kvmesh

# Real tokenizers and chat templates (vocabulary-only GGUFs from the llama-cpp-python sdist), once.
vocab: $(STAMP)
	@$(BIN)/python -m kvmesh.node.engine.vocab fetch >/dev/null

test: $(STAMP) sysdeps lint vocab
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)

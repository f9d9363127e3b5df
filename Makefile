# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# `make demo ARGS="key=value ..."` passes Hydra overrides to the demo.
# Each creates (or refreshes) .venv on its own. The CPU set-up pins torch
# through constraints-cpu.txt; on a GPU machine install into your own
# environment with `pip install -e .` (and `.[vllm]` if you want vLLM).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-all bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m omnirl_async.demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q -p no:cacheprovider

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_buffer.py
	$(BIN)/python benchmarks/bench_reward.py

clean:
	rm -rf $(VENV) tensorboard_log checkpoints outputs

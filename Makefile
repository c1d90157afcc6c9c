.DEFAULT_GOAL := help
PYTHON ?= python3
HYPOTHESIS_PROFILE ?= ci
export HYPOTHESIS_PROFILE
# the tests that hold the native front to the Python path's goldens (tests/gateway/goldens.py)
PARITY_TESTS = $(addprefix tests/gateway/,test_front_native.py test_front_responses.py \
	test_front_refusals.py test_front_errors.py test_tally.py test_front_mangled.py \
	test_front_tls.py test_disagg.py test_shadow.py test_telemetry.py)

.PHONY: help
help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-12s %s\n", $$1, $$2}'

.PHONY: install
install: ## Install llmflow (builds the Rust core) with test and dev extras
	$(PYTHON) -m pip install -e '.[test,dev]'

.PHONY: build-dev
build-dev: ## Rebuild the Rust extension in place after editing rust/src
	$(PYTHON) -m pip install --no-deps --no-build-isolation -e .

.PHONY: vllm
vllm: ## Build (or reuse) the cached real-vLLM venv the integration tests use
	scripts/vllm_env.sh

.PHONY: deps
deps: ## Install what the tests need beyond Python packages: Debian's chromium and redis-server
	@command -v chromium >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium (dashboard browser test) and redis-server (shared state)"; \
	  $(if $(filter 0,$(shell id -u)),,sudo) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y -q chromium redis-server; }

.PHONY: test
test: deps ## Run every test: cargo test, then pytest (unit, simulator, property, integration)
	cargo test --quiet
	$(PYTHON) -m pytest tests sim property_tests -m "not reliability"

.PHONY: test-fast
test-fast: ## Everything except the real-vLLM integration tests
	cargo test --quiet
	HYPOTHESIS_PROFILE=fast $(PYTHON) -m pytest tests sim property_tests -m "not integration and not reliability"

.PHONY: reliability
reliability: ## The flood: 10,000 connections, a 5,000-request burst, VIP latency, RSS (minutes)
	$(PYTHON) -m pytest tests/reliability -m reliability -s

.PHONY: props
props: ## Property tests only
	$(PYTHON) -m pytest property_tests

.PHONY: lint
lint: ## ruff, mypy, stubtest, rustfmt and clippy
	$(PYTHON) -m ruff check python tests property_tests benchmarks
	$(PYTHON) -m mypy python/llmflow
	$(PYTHON) -m mypy.stubtest llmflow._core --allowlist .stubtest-allowlist
	cargo fmt --check
	cargo clippy --tests -- -D warnings

.PHONY: bench
bench: ## Core benchmark (Rust, PyO3 and the reference model side by side)
	$(PYTHON) -m benchmarks.core_bench

.PHONY: goldens
goldens: ## Rewrite the simulator's golden .out files (review the diff before committing)
	LLMFLOW_UPDATE_GOLDENS=1 $(PYTHON) -m pytest sim

.PHONY: parity-goldens
parity-goldens: ## Record the parity tests' goldens from the Python path (review the diff before committing)
	LLMFLOW_RECORD_GOLDENS=1 $(PYTHON) -m pytest -q $(PARITY_TESTS)

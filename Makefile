# Two entry points do all set-up on a fresh machine:
#   make demo   -- local 1P1D push demo over real NIXL (two processes, bytes verified)
#   make test   -- the whole suite (unit, NIXL integration, faults, real-vLLM end to end)
VENV ?= .venv
VENV029 ?= .venv-vllm029
STAMP := $(VENV)/.kv-push-installed
STAMP029 := $(VENV029)/.kv-push-installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench-transfer bench-serving clean-venv

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/vllm_cpu_alias.py
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

$(STAMP029): pyproject.toml scripts/setup_env.sh scripts/vllm_cpu_alias.py
	KV_PUSH_VLLM_VERSION=0.29.0 bash scripts/setup_env.sh $(VENV029)
	touch $(STAMP029)

demo: $(STAMP)
	$(VENV)/bin/kv-push-demo

test: $(STAMP) $(STAMP029)
	KV_PUSH_E2E_VENVS="0.32=$(VENV),0.29=$(VENV029)" $(VENV)/bin/python -m pytest -q -rs $(PYTEST_ARGS) tests

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -rs -m "not e2e" tests

bench-transfer: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_transfer.py

bench-serving: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_serving.py

clean-venv:
	rm -rf $(VENV) $(VENV029)

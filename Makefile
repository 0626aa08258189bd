# `make test` works on a fresh clone: it creates the project's own .venv and installs
# requirements-dev.txt, re-installing only when requirements-dev.txt / setup.cfg / setup.py
# change (stamp file in the venv). A virtualenv that happens to be active is left alone;
# `make test VENV=/path/to/venv` uses (and creates) that one instead.

VENV ?= .venv
PY   := $(VENV)/bin/python
STAMP := $(VENV)/.ppe-snapshot-dev.stamp

.DEFAULT_GOAL := test
.PHONY: venv test demo bench clean distclean

venv: $(STAMP)

$(STAMP): requirements-dev.txt setup.cfg setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -r requirements-dev.txt
	@# Azurite, Azure's blob storage emulator, for the az:// tests (skipped where npm is missing)
	-command -v npm >/dev/null && npm install --prefix $(VENV)/node --no-audit --no-fund --silent azurite@3
	touch $@

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(PY) examples/demo.py

bench: venv
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf build dist *.egg-info .pytest_cache benchmarks/out
	find . -path ./.venv -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf .venv

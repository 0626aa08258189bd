# `make test` works on a fresh clone: it creates .venv (unless a virtualenv is
# already active) and installs requirements-dev.txt, re-installing only when
# requirements-dev.txt / setup.cfg / setup.py change (stamp file in the venv).

ifeq ($(strip $(VIRTUAL_ENV)),)
VENV := .venv
PY   := $(VENV)/bin/python
else
VENV := $(VIRTUAL_ENV)
PY   := python
endif
STAMP := $(VENV)/.ppe-snapshot-dev.stamp

.DEFAULT_GOAL := test
.PHONY: venv test demo bench clean distclean

venv: $(STAMP)

$(STAMP): requirements-dev.txt setup.cfg setup.py
ifeq ($(strip $(VIRTUAL_ENV)),)
	test -x $(PY) || python3 -m venv $(VENV)
endif
	$(PY) -m pip install -r requirements-dev.txt
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

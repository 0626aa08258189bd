# `make test` and `make demo` work on a fresh clone: they create the project's own .venv. `make demo` installs
# requirements.txt (the library and torch), `make test` requirements-dev.txt (that, plus the test stack);
# each re-installs only when its requirements / setup.cfg / setup.py change (stamp files in the venv).
# A virtualenv that happens to be active is left alone; `make test VENV=/path/to/venv` uses (and creates) that one.

VENV ?= .venv
PY   := $(VENV)/bin/python
STAMP := $(VENV)/.ppe-snapshot-dev.stamp
RUN_STAMP := $(VENV)/.ppe-snapshot-run.stamp

.DEFAULT_GOAL := test
.PHONY: venv test demo floors bench gpu-check gpu-native gpu-tests gpu-bench gpu-example gpu-staging gpu-many gpu-wheels \
	clean distclean

venv: $(STAMP)

# The install also builds the C helpers of the checksums and the local reads (setup.py; without a compiler it goes
# on without them).
NATIVE_SRC := ppe_snapshot/engine/_files/hash_many.c ppe_snapshot/storage/preadv_all.c

$(RUN_STAMP): requirements.txt setup.cfg setup.py $(NATIVE_SRC)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $@

$(STAMP): requirements-dev.txt requirements.txt setup.cfg setup.py $(NATIVE_SRC)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -r requirements-dev.txt
	$(call azurite,$(VENV))
	touch $@ $(RUN_STAMP)

# Two pytest-xdist workers, a test file to each at a time (its module fixtures made once); the suite is mostly
# processes starting and waiting on each other, which two workers overlap on CI's 2 cores.
SUITE := -m pytest -q -n 2 --dist loadfile tests
test: venv
	$(PY) $(SUITE)

demo: $(RUN_STAMP)
	$(PY) examples/demo.py

# The suite on the lowest releases setup.cfg allows, in two virtualenvs of their own: requirements-floors.txt (every
# requirement and s3fs), then requirements-floors-stores.txt (gcsfs and adlfs, which need a newer fsspec).
floors:
	$(call suite_on,.venv-floors,requirements-floors.txt)
	$(call azurite,.venv-floors-stores)
	$(call suite_on,.venv-floors-stores,requirements-floors-stores.txt)

# Azurite, Azure's blob storage emulator, into virtualenv $(1) for the az:// tests (skipped where npm is missing).
define azurite
-command -v npm >/dev/null && npm install --prefix $(1)/node --no-audit --no-fund --silent azurite@3
endef

# The suite in virtualenv $(1), created where missing, with requirements file $(2) installed.
define suite_on
test -x $(1)/bin/python || python3 -m venv $(1)
$(1)/bin/python -m pip install -r $(2)
$(1)/bin/python $(SUITE)
endef

bench: venv
	$(PY) benchmarks/bench_engine.py

# The checks that need a CUDA GPU (CI has none, and these tests skip there): the CUDA tests, benchmarks/bench_gpu.py
# (issue 35's figures), the FSDP2 example over NCCL (stopped at 25, resumed on the GPU, then resumed on two CPU
# ranks over gloo), staging with the state on the GPU, and where 10,000 small CUDA tensors' save and restore spend
# their time, the restore variant by variant and with the checksums' C helper against without (gpu-many). GPU_PY: a
# Python whose torch has CUDA, with this package's requirements. Each step has its own target, time limit and log
# (GPU_LOG), so that one hang costs only itself and a lent GPU's calls can split them: on an H200, gpu-tests took
# 55-87 s, gpu-bench about 215 s (its peers about 70 s of it), gpu-example 48 s, gpu-staging 53-56 s and gpu-many
# about 30 s before probe_many_restore.py and bench_native_hash.py joined it.
# (bench_gpu.py's --read-workers and --sweep, which settled DEVICE_READ_WORKERS and SMALL_DEVICE_BYTES, are left out.)
GPU_PY ?= $(PY)
GPU_RUN := /tmp/ppe-snapshot-gpu-check
GPU_LOG ?= /tmp/ppe-snapshot-gpu-logs
CUDA_TESTS := $(shell grep -l "needs CUDA" tests/test_*.py)
GPU_VENV := $(if $(filter $(PY),$(GPU_PY)),venv,gpu-native)
gpu-check: gpu-tests gpu-bench gpu-example gpu-staging gpu-many

# A GPU_PY that runs this tree without installing it (PYTHONPATH) builds the C helpers in place; where that machine
# has no C compiler, Python does their work (the line printed says which are in use).
gpu-native:
	mkdir -p $(GPU_LOG)
	-$(GPU_PY) setup.py -q build_ext --inplace > $(GPU_LOG)/native.log 2>&1; $(GPU_PY) -c "from \
		ppe_snapshot.engine._files import chunk_hashes as c; from ppe_snapshot.storage import local_reads as r; \
		print('native checksums:', c.NATIVE is not None, '- native local reads:', r.READ_ALL is not None)"

# Made here, before a GPU is lent: the wheels the GPU machine lacks (it reaches no package index; ../shared/GPU.md),
# for its Python 3.12 on x86-64, into the ignored .whl/. There: W=$$(mktemp -d); python3 -m pip install -q --no-index
# --no-deps --target $$W/site .whl/*.whl && export PYTHONPATH=$$W/site:$$PWD; then make gpu-check GPU_PY=python3.
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 -d .whl pytorch-pfn-extras==0.9.0 orjson

gpu-tests: $(GPU_VENV)
	mkdir -p $(GPU_LOG)
	-timeout 240 $(GPU_PY) -m pytest -q -k cuda $(CUDA_TESTS) > $(GPU_LOG)/tests.log 2>&1; tail -3 $(GPU_LOG)/tests.log

gpu-bench: $(GPU_VENV)
	mkdir -p $(GPU_LOG)
	-timeout 300 $(GPU_PY) benchmarks/bench_gpu.py --gib 4 --rounds 3 > $(GPU_LOG)/bench_gpu.log 2>&1; \
		tail -40 $(GPU_LOG)/bench_gpu.log

gpu-example: $(GPU_VENV)
	rm -rf $(GPU_RUN) && mkdir -p $(GPU_LOG)
	-( timeout 100 $(GPU_PY) -m torch.distributed.run --nproc_per_node=1 examples/train_sharded.py --device cuda \
		--out $(GPU_RUN) --stop-at 25 && \
	   timeout 100 $(GPU_PY) -m torch.distributed.run --nproc_per_node=1 examples/train_sharded.py --device cuda \
		--out $(GPU_RUN) && \
	   GLOO_SOCKET_IFNAME=lo timeout 100 $(GPU_PY) -m torch.distributed.run --nproc_per_node=2 \
		examples/train_sharded.py --out $(GPU_RUN) --iterations 50 ) > $(GPU_LOG)/example.log 2>&1; \
		echo "train_sharded: exit $$?"; tail -3 $(GPU_LOG)/example.log

gpu-staging: $(GPU_VENV)
	mkdir -p $(GPU_LOG)
	-timeout 150 $(GPU_PY) benchmarks/bench_staging.py --device cuda --rounds 3 --many 10000 --rss 0 --prepare \
		> $(GPU_LOG)/bench_staging.log 2>&1; tail -25 $(GPU_LOG)/bench_staging.log

gpu-many: $(GPU_VENV)
	mkdir -p $(GPU_LOG)
	-for what in writer restore; do timeout 60 $(GPU_PY) benchmarks/bench_many_tensors.py --profile $$what \
		--count 10000 --device cuda > $(GPU_LOG)/many_$$what.log 2>&1; head -30 $(GPU_LOG)/many_$$what.log; done
	-timeout 120 $(GPU_PY) benchmarks/probe_many_restore.py --device cuda > $(GPU_LOG)/probe_many.log 2>&1; \
		tail -9 $(GPU_LOG)/probe_many.log
	-timeout 120 $(GPU_PY) benchmarks/bench_native_hash.py --device cuda --rounds 4 > $(GPU_LOG)/native_hash.log 2>&1; \
		tail -4 $(GPU_LOG)/native_hash.log

clean:
	rm -rf build dist *.egg-info .pytest_cache benchmarks/out
	find . \( -path ./.venv -o -path ./.venv-floors -o -path ./.venv-floors-stores \) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf .venv .venv-floors .venv-floors-stores ppe_snapshot/engine/_files/libhash_many.so ppe_snapshot/storage/libpreadv_all.so

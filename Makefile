# Two commands do all the set-up on a fresh clone:
#   make demo   -> .venv, install, native build, a small synthetic graph, its summary, a short training run
#                  through the CLI (configs/demo.yaml), printing accuracy and throughput
#   make test   -> the same set-up, then the test suite (make test-all adds the longer variants marked slow)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DEMO   ?= data/demo
# The exact torch pin keeps a CPU-only machine on its local CPU wheel.
TORCH_PIN ?= torch==2.13.0

EXT_SRC := $(wildcard ext/*/*.c ext/*/*.cpp ext/*/*.h ext/include/*.h) setup.py

.PHONY: all setup ext demo test test-all gpu-check gpu-bundle gpu-install clean distclean system-deps

all: setup

system-deps:
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	  missing=""; \
	  [ -f /usr/include/liburing.h ] || missing="$$missing liburing-dev"; \
	  command -v fio >/dev/null 2>&1 || missing="$$missing fio"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	elif [ ! -f /usr/include/liburing.h ]; then \
	  echo "note: liburing-dev is missing and we are not root; io_uring will be compiled out"; \
	fi

$(VENV)/.installed: pyproject.toml setup.py
	$(MAKE) system-deps
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e '.[dev]'
	touch $@

# Rebuild the native modules in place whenever a source changes.
$(VENV)/.ext: $(VENV)/.installed $(EXT_SRC)
	$(PY) setup.py -q build_ext --inplace
	touch $@

setup: $(VENV)/.ext
ext: $(VENV)/.ext

demo: setup
	$(VENV)/bin/lightning-ooc synth --config configs/synth/demo.yaml --out $(DEMO) --overwrite
	$(VENV)/bin/lightning-ooc info $(DEMO)
	$(VENV)/bin/lightning-ooc fit --config configs/demo.yaml --data.root $(DEMO) --trainer.logger false \
	  --trainer.default_root_dir $(DEMO)-run \
	  --trainer.enable_checkpointing false

# make test leaves out the tests marked slow (longer variants of tests it runs) to stay under 15 minutes on
# 2 cores; make test-all runs them too.
test: setup
	$(PY) -m pytest -q -ra --durations=15 -m "not gpu and not slow"

test-all: setup
	$(PY) -m pytest -q -ra -m "not gpu"

# On a machine with CUDA: the tests marked gpu, the zero-copy bandwidth against pinned cudaMemcpy, a table
# and gpu-check.json (lightning_ooc/bench/gpu.py). Without CUDA: one line, exit status 0. It uses .venv
# where there is one, else the machine's python3 with the package installed in place
# (pip install --no-deps --no-build-isolation -e .).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
# GPU_CHECK_ARGS: more options of `lightning-ooc bench gpu`, e.g. "--no-epoch" or "--skip-tests --no-bandwidth"
GPU_CHECK_ARGS ?=
gpu-check:
	@$(GPU_PY) -m lightning_ooc bench gpu --out gpu-check $(GPU_CHECK_ARGS)

# For a GPU machine without network or apt: `make gpu-bundle` here (with network) fetches liburing's Debian
# packages and the wheels of the CLI's jsonargparse into gpu-bundle/; bring that folder along, then
# `make gpu-install` there unpacks liburing (linked statically), installs the wheels its Python lacks and the
# package in place, and says which I/O backends the build has.
GPU_BUNDLE ?= gpu-bundle
gpu-bundle:
	mkdir -p $(GPU_BUNDLE)/deb $(GPU_BUNDLE)/wheels
	cd $(GPU_BUNDLE)/deb && apt-get download liburing-dev liburing2
	$(PYTHON) -m pip download -q -d $(GPU_BUNDLE)/wheels 'jsonargparse[signatures]>=4.27'
	@du -sh $(GPU_BUNDLE)

gpu-install:
	@test -d $(GPU_BUNDLE)/deb || { echo "no $(GPU_BUNDLE)/: run make gpu-bundle on a machine with network and bring it"; exit 2; }
	rm -rf $(GPU_BUNDLE)/root && mkdir -p $(GPU_BUNDLE)/root
	for d in $(GPU_BUNDLE)/deb/*.deb; do dpkg -x $$d $(GPU_BUNDLE)/root; done
	$(PYTHON) -m pip install -q --no-index --find-links $(GPU_BUNDLE)/wheels 'jsonargparse[signatures]>=4.27'
	LIBURING_PREFIX=$(CURDIR)/$(GPU_BUNDLE)/root $(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -c "from lightning_ooc.io import available_backends as b; print('io_uring:', b('.')['uring'])"

clean:
	rm -rf build lightning_ooc/*.so $(VENV)/.ext
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) data *.egg-info

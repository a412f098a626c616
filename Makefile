# fastroute developer entry points. `make test` does all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: all system-packages venv build debug annotate test test-compiled test-pure bench-smoke bench lint clean run engines \
	test-real

all: test

# Create the venv and install the project (editable) with its test extras.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel "Cython>=3.0,<4"
	$(BIN)/pip install -q --no-build-isolation -e '.[test]'
	touch $@

venv: $(STAMP)

# (Re)build the Cython extensions in place; Cython skips unchanged modules.
build: $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace

# Bounds checks and line tracing on (slow; for debugging and coverage only).
debug: $(STAMP)
	FASTROUTE_CYTHON_DEBUG=1 $(BIN)/python setup.py -q build_ext --inplace --force

# HTML annotation of the compiled core (yellow = Python interaction).
annotate: $(STAMP)
	FASTROUTE_CYTHON_ANNOTATE=1 $(BIN)/python setup.py -q build_ext --inplace --force
	@ls fastroute/_core/*.html

lint: $(STAMP)
	$(BIN)/ruff check fastroute controller tests bench setup.py

test-compiled: build
	$(BIN)/python -m pytest

# The parity-critical tests once more against the pure-Python twins.
test-pure: build
	FASTROUTE_NO_EXTENSIONS=1 $(BIN)/python -m pytest -m parity

# Every benchmark once, untimed: proves they still run.
bench-smoke: build
	$(BIN)/python -m pytest bench --benchmark-disable -q

# Debian packages the suite runs for real (etcd, promtool): deploy/system_packages.sh.
system-packages:
	bash deploy/system_packages.sh

test: system-packages lint test-compiled test-pure bench-smoke

# The real-engine tier: vLLM (CPU build) and a tiny random-weight model, installed once into
# $${FASTROUTE_REAL_CACHE:-~/.cache/fastroute-real} and reused, then tests/real against them.
test-real: build
	bash tests/real/setup_vllm.sh
	$(BIN)/python -m pytest -m real tests/real $(REAL_ARGS)

# Timed benchmarks (see docs/benchmarks.md for how to read them).
bench: build
	$(BIN)/python -m pytest bench --benchmark-only --benchmark-columns=min,median,mean,stddev,rounds \
		--benchmark-sort=name $(BENCH_ARGS)

# The main job on the embedded default: emulated engines in two regions, the controller and a
# proxy per region on loopback, 60 s of multi-turn chat, a summary (docs/demo.md).
run: build
	$(BIN)/fastroute demo $(DEMO_ARGS)

# The four emulated engines examples/fastroute.toml expects (127.0.0.1:9100-9103).
engines: build
	$(BIN)/fastroute engine --count 4 --base-port 9100 --model demo-8b

clean:
	rm -rf build fastroute/_core/*.c fastroute/_core/*.so fastroute/_core/*.html .pytest_cache .benchmarks

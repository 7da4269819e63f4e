# The README's commands. `make test` builds its own virtualenv from nothing.
PYTHON ?= python3
VENV ?= .venv
PROTO_VENV ?= .venv-proto
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-scale test-gpu proto proto-check lint clean

# What `make demo` needs: gridcomm and its runtime dependencies only.
$(BIN)/.installed-run: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

# What `make test` and `make lint` need on top: the development toolchain.
$(BIN)/.installed: $(BIN)/.installed-run
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q -e '.[netns]' 2>/dev/null || \
		echo "note: NetfilterQueue did not build (libnetfilter-queue-dev missing?); latency tests will skip"
	touch $@

demo: $(BIN)/.installed-run
	$(BIN)/gridcomm demo

# pytest exits 5 when it collected no test; that is reported, not hidden, but is not a failure
# of the suite itself.
test: $(BIN)/.installed
	$(BIN)/python -m pytest -m "not scale and not gpu" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; rc=0; fi; exit $$rc

# On the GPU machine (system Python with CuPy and NCCL; carried wheels, see README).
test-gpu:
	bash scripts/gpu_check.sh

test-scale: $(BIN)/.installed
	$(BIN)/python -m pytest -m scale -s $(PYTEST_ARGS)

# Wire fuzzing of the coordinator at >= 10,000 cases (`make test` runs the same file at >= 1,000).
.PHONY: fuzz
fuzz: $(BIN)/.installed
	GRIDCOMM_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest tests/test_fuzz.py -s $(PYTEST_ARGS)

$(PROTO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/python -m pip install -q 'grpcio-tools==1.62.3'
	touch $@

# The .proto also ships in the package (beside the stubs, for tools without reflection): a copy.
proto: $(PROTO_VENV)/.installed
	$(PROTO_VENV)/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
		protos/gridcomm/_proto/coordinator.proto
	cp protos/gridcomm/_proto/coordinator.proto gridcomm/_proto/coordinator.proto

proto-check: $(PROTO_VENV)/.installed
	rm -rf .proto-check && mkdir -p .proto-check
	$(PROTO_VENV)/bin/python -m grpc_tools.protoc -Iprotos --python_out=.proto-check --grpc_python_out=.proto-check \
		--pyi_out=.proto-check protos/gridcomm/_proto/coordinator.proto
	cp protos/gridcomm/_proto/coordinator.proto .proto-check/gridcomm/_proto/
	diff -r -x __init__.py -x __pycache__ .proto-check/gridcomm/_proto gridcomm/_proto && echo "generated stubs are up to date"
	rm -rf .proto-check

# The CPU rendezvous benchmark (about 10-15 minutes at the default subset); rewrites its section of
# BENCHMARKS.md and benchmarks/rendezvous.png. Its peers live in a virtualenv of their own.
BENCH_VENV ?= .venv-bench
BENCH_ARGS ?= --ranks 8,32,128,512,2048 --reps 3

$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -e '.[bench]'
	touch $@

.PHONY: bench
bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/rendezvous.py $(BENCH_ARGS) --markdown BENCHMARKS.md

# The host backend's all_reduce against torch's gloo (a few minutes); prints a table for
# BENCHMARKS.md. Its peer lives in a virtualenv of its own, with only the CPU build of torch.
GLOO_VENV ?= .venv-gloo
BENCH_HOST_ARGS ?= --ranks 4 --sizes 4,1048576,16777216 --reps 7

$(GLOO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(GLOO_VENV)
	$(GLOO_VENV)/bin/python -m pip install -q --upgrade pip
	$(GLOO_VENV)/bin/python -m pip install -q -e '.[bench-gloo]'
	touch $@

.PHONY: bench-host
bench-host: $(GLOO_VENV)/.installed
	$(GLOO_VENV)/bin/python benchmarks/host_collectives.py $(BENCH_HOST_ARGS)

# Ranks killed on loopback (4 ranks, host backend, default bounds): kill -> every rank good again
# with recovery in place, and rank 0's death with the coordinator inside it (a few minutes).
CHAOS_ARGS ?=

.PHONY: chaos
chaos: $(BIN)/.installed-run
	$(BIN)/python benchmarks/chaos.py $(CHAOS_ARGS)

lint: $(BIN)/.installed
	$(BIN)/python scripts/check_imports.py
	$(BIN)/ruff check gridcomm tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(PROTO_VENV) $(GLOO_VENV) .proto-check .pytest_cache

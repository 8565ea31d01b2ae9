# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test lint format demo bench model-cards clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: a bare torch requirement would otherwise pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev,examples]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m st_cached_losses.demo

bench: $(STAMP)
	$(PY) benchmarks/loss_stage.py

# On a machine with an NVIDIA GPU: its own .venv-gpu with a CUDA torch, the suite with --device cuda
# and the loss-stage and training-step benchmarks on the GPU, results in benchmarks/results/gpu/.
# Without one (CI): a one-line no-op, exit 0. See benchmarks/gpu_check.sh for the knobs.
.PHONY: gpu-check
gpu-check:
	@PYTHON="$(PYTHON)" bash benchmarks/gpu_check.sh

# The model cards in model_cards/, regenerated from the demo and the examples (about 4.5 minutes on 2 CPU
# cores). The demo writes its card for DEMO_REPO; the push_to_hub dry run (tests/support/hub_recorder.py, nothing
# is sent) copies the folder a real push would upload to output/demo_hub_upload, whose card is demo.md.
DEMO_REPO := your-username/all-MiniLM-L6-v2-stdlib-cached-mnr
ACCELERATE_2 := $(VENV)/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
	--mixed_precision no --dynamo_backend no
model-cards: $(STAMP)
	$(PY) -m st_cached_losses.demo --disable_tqdm true --loss_show_progress_bar false --hub_model_id $(DEMO_REPO)
	$(PY) -m tests.support.hub_recorder output/demo $(DEMO_REPO)
	cp output/demo_hub_upload/README.md model_cards/demo.md
	$(PY) examples/train_cached_mnr.py --disable_tqdm true
	cp output/examples/cached_mnr/README.md model_cards/cached_mnr.md
	$(PY) examples/train_cached_clip.py --disable_tqdm true
	cp output/examples/cached_clip/README.md model_cards/cached_clip.md
	$(PY) examples/train_cached_tiled.py --disable_tqdm true
	cp output/examples/cached_tiled/README.md model_cards/cached_tiled.md
	$(ACCELERATE_2) examples/train_accelerate.py --disable_tqdm true
	cp output/examples/accelerate/README.md model_cards/accelerate.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

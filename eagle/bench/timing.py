"""Time decoding at a model shape with random weights: a round's cost needs no checkpoint.

With static caches every EAGLE round has the same shapes whatever the weights: the target
verifies the whole padded tree (root + N nodes) and the drafter runs its catch-up (padded to
depth + 1 tokens) and one pass per depth. A target of the real shape with random weights
therefore times a round as a trained one would, and a random drafter (almost never
accepted) changes only tau. With the tau measured on a trained target (a benchmark's
results.json), round time / tau projects the time per token at that shape. It is a
projection, not a measurement: tau at that size is not measured, and the report says so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagle.bench.benchmark import summarise
from eagle.bench.floor import weight_bytes
from eagle.bench.methods import Method, MethodError, MethodSpec, build_method
from eagle.hardware import gpu_bandwidth_gb_s, resolve_dtype_name
from eagle.sampling import SamplingPolicy
from eagle.target import resolve_dtype

if TYPE_CHECKING:
    from eagle.bench.builder import Methods

# what a timed method reports (eagle.bench.benchmark.MethodResult fields)
TIMED = (
    "tau",
    "ms_per_token",
    "ms_per_round",
    "draft_ms_per_round",
    "verify_ms_per_round",
    "new_tokens",
    "peak_memory_mb",
    "tree_parents",
)


def random_target(
    shape: Mapping, dtype: str | torch.dtype, device: str | torch.device, seed: int = 0
) -> nn.Module:
    """A causal LM of `shape` (kwargs of `AutoConfig.for_model`; `model_type` defaults to llama)
    with random weights, built directly on `device` in `dtype`; it never stops at an EOS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(shape)
    config = AutoConfig.for_model(shape.pop("model_type", "llama"), **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype))
    # random weights: stopping early would shorten the timing
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False)


def time_methods(
    target: nn.Module,
    methods: Mapping[str, Method],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    seed: int = 0,
) -> dict[str, dict]:
    """Greedy-decode one random prompt `repeats` times with each method, after one untimed
    generation that compiles (and records) every graph; returns the `TIMED` figures per method."""
    device = next(target.parameters()).device
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, target.config.vocab_size, (prompt_len,), generator=g).tolist()
    policy, out = SamplingPolicy(), {}
    for name, method in methods.items():
        start = time.perf_counter()
        method.generate(prompt, new_tokens, policy)
        warmup = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        outcomes = [method.generate(prompt, new_tokens, policy) for _ in range(repeats)]
        result = summarise(method, dtype, outcomes)
        if device.type == "cuda":
            result.peak_memory_mb = torch.cuda.max_memory_allocated(device) / 2**20
        out[name] = {k: getattr(result, k) for k in TIMED} | {"warmup_s": warmup}
    return out


def project(timed: Mapping[str, dict], results: dict) -> list[dict]:
    """Projected ms per token at the timed shape: the timed static EAGLE round (`eagle:static`)
    divided by the tau a benchmark report (`results`, a trained target) measured, per eval set
    and temperature. The tau must come from the timed tree: a round of one tree divided by the
    tau of another projects nothing (checked where both record their tree)."""
    if "eagle:static" not in timed:
        raise ValueError("a projection needs the timed round of method eagle:static")
    round_ms, tree = (
        timed["eagle:static"]["ms_per_round"],
        timed["eagle:static"].get("tree_parents"),
    )
    base_ms = timed.get("vanilla:static", {}).get("ms_per_round")
    rows = []
    for run in results["runs"]:
        source = next((k for k in ("eagle:static", "eagle") if k in run["methods"]), None)
        if source is None:
            continue
        measured_on = run["methods"][source].get("tree_parents")
        if tree is not None and measured_on is not None and list(measured_on) != list(tree):
            raise ValueError(
                f"the tau of {source} ({run['eval_set']}, T={run['temperature']:g}) was measured "
                "on a "
                f"tree of {len(measured_on)} nodes, the timed round verifies one of {len(tree)}: "
                "benchmark "
                "eagle with the timed eagle.tree"
            )
        tau = run["methods"][source]["tau"]
        ms = round_ms / tau
        rows.append(
            {
                "kind": "projection",
                "eval_set": run["eval_set"],
                "temperature": run["temperature"],
                "tau": tau,
                "tau_method": source,
                "tau_target": run["target"],
                "round_ms": round_ms,
                "projected_ms_per_token": ms,
                "projected_speedup_vs_static": base_ms / ms if base_ms else None,
            }
        )
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"### Timing at {report['shape_name']} shape, random weights ({report['params_b']:.2f}B "
        "parameters, "
        f"{report['dtype']}, {report['device']}, compile: {report['compile_mode']})",
        "",
        f"Bandwidth floor: {report['floor_ms_per_token']:.2f} ms/token ({report['weights_gb']:.1f} "
        "GB of "
        f"weights read once per token at {report['bandwidth_gb_s']:g} GB/s).",
        "",
        "| method | ms/token | ms/round after prefill | draft + verify ms/round | tau (random "
        "drafter) | "
        "first generation s |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, m in report["methods"].items():
        lines.append(
            f"| {name} | {m['ms_per_token']:.2f} | {m['ms_per_round']:.2f} | "
            f"{m['draft_ms_per_round']:.2f} + {m['verify_ms_per_round']:.2f} | {m['tau']:.2f} | "
            f"{m['warmup_s']:.1f} |"
        )
    if report.get("projection"):
        lines += [
            "",
            "**Projection** (not a measurement): the timed eagle:static round divided by the tau "
            "measured on a trained target.",
            "",
            "| eval set | T | tau (measured, trained target) | projected ms/token | projected "
            "speedup vs "
            "vanilla:static |",
            "|---|---:|---:|---:|---:|",
        ]
        for p in report["projection"]:
            speedup = (
                "-"
                if p["projected_speedup_vs_static"] is None
                else f"{p['projected_speedup_vs_static']:.2f}x"
            )
            lines.append(
                f"| {p['eval_set']} | {p['temperature']:g} | {p['tau']:.2f} | "
                f"{p['projected_ms_per_token']:.2f} | {speedup} |"
            )
    return "\n".join(lines) + "\n"


def write_timing(report: dict, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "timing.json").write_text(json.dumps(report, indent=2))
    (out_dir / "timing.md").write_text(markdown(report))
    return out_dir


@dataclass(frozen=True)
class TimingConfig:
    """configs/decode.yaml's `timing` section, whose comments give each setting's reason."""

    shape_name: str  # the shape's name in the report
    shape: Mapping[str, Any]  # `random_target`'s shape
    dtype: str  # auto: bfloat16 where bf16 is fast, else float32
    methods: Sequence[str]  # vanilla and eagle, with any runner
    prompt_len: int
    new_tokens: int  # per timed generation
    repeats: int
    max_len: int  # static cache slots
    bandwidth_gb_s: float | None  # for the floor; None: the GPU's nominal one
    tau_from: str | None  # a benchmark's results.json: the projection's tau
    measured: str | None  # a timing.json: time nothing, only add the projection
    out_dir: str | Path


def _read_json(path: str, key: str) -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{key}: {path} does not exist")
    return json.loads(Path(path).read_text())


def run_timing(methods: Methods, tc: TimingConfig, seed: int = 0) -> Path:
    """Time `tc.methods` on a random-weight target of `tc.shape`, or, with `tc.measured`, only
    add the projection to an earlier timing.json. `methods` builds them (its eagle section with
    a random drafter: only the drafter's cost matters). Prints timing.md, returns its folder."""
    for name in tc.methods:
        if MethodSpec.parse(name).base not in ("vanilla", "eagle"):
            raise MethodError(f"timing runs vanilla and eagle (with any runner), not {name!r}")
    results = None
    if tc.tau_from:
        results = _read_json(tc.tau_from, "timing.tau_from (a benchmark's results.json)")
    if results is not None and not tc.measured and "eagle:static" not in tc.methods:
        raise MethodError("a projection (timing.tau_from) needs eagle:static among timing.methods")
    if tc.measured:
        report = _read_json(tc.measured, "timing.measured (a timing.json)")
        report["tau_from"] = str(tc.tau_from) if tc.tau_from else None
        report["projection"] = project(report["methods"], results) if results is not None else None
        return _written(report, tc.out_dir)
    shape, device = dict(tc.shape), methods.device
    dtype = resolve_dtype_name(tc.dtype, device)
    target = random_target(shape, dtype, device, seed=seed)
    gb = weight_bytes(target) / 1e9
    cuda = device.startswith("cuda")
    device_name = torch.cuda.get_device_name(device) if cuda else device
    bandwidth = tc.bandwidth_gb_s or gpu_bandwidth_gb_s(device_name)
    if bandwidth is None:
        raise ValueError(
            f"no nominal memory bandwidth is known for {device_name!r}: give "
            "timing.bandwidth_gb_s (GB/s) for the floor"
        )
    report = {
        "kind": "timing",
        "shape_name": tc.shape_name,
        "shape": shape,
        "params_b": sum(p.numel() for p in target.parameters()) / 1e9,
        "dtype": dtype,
        "device": device_name,
        "compile_mode": methods.compile_mode,
        "tree": methods.sections["eagle"].get("tree"),
        "prompt_len": tc.prompt_len,
        "new_tokens": tc.new_tokens,
        "repeats": tc.repeats,
        "weights_gb": gb,
        "bandwidth_gb_s": bandwidth,
        "floor_ms_per_token": 1000 * gb / bandwidth,
        "methods": {},
        "tau_from": str(tc.tau_from) if tc.tau_from else None,
        "projection": None,
        "torch": torch.__version__,
    }
    for name in tc.methods:  # the report is rewritten after each: a killed run keeps what it timed
        method = build_method(name, methods.context(dtype, target=target), methods.sections)
        report["methods"] |= time_methods(
            target, {name: method}, tc.prompt_len, tc.new_tokens, tc.repeats, seed=seed
        )
        write_timing(report, tc.out_dir)
    if results is not None:
        report["projection"] = project(report["methods"], results)
    return _written(report, tc.out_dir)


def _written(report: dict, out_dir: str | Path) -> Path:
    out = write_timing(report, out_dir)
    print((out / "timing.md").read_text())
    return out

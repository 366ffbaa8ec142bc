"""Where a speculative round's time goes: drafting and verification split into their parts.

`RoundProfile` wraps the functions a round calls (the drafter's forward and LM head, the
top-k/sampling of the children, the drafter's mask building and cache bookkeeping; the
target's tree forward, logits processing, acceptance and KV compaction) with wall-clock
timers, decodes, and reports each part per round and per drafter pass. What the timers do not
cover inside drafting or verification is the Python bookkeeping between the calls. On a GPU
each timer synchronises first, so kernels are charged to the part that launched them.

Under sampling the target's p is computed row by row as the verifier reads it
(`eagle.sampling.RowProbs`), inside the acceptance: "acceptance" includes it, and "target:
logits processing" reads 0.

The timers cost about a microsecond per call (a round makes a few dozen), and on a GPU each
synchronises: the speedups therefore come from decodes without timers, EAGLE and vanilla in
turns prompt by prompt, and the timed decode only splits the round ("round without the
timers" in the report).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle.artifacts import write_report
from eagle.bench.benchmark import encode_prompt, warm_up
from eagle.bench.evalsets import load_eval_set
from eagle.decoding.stats import DecodeStats
from eagle.progress import progress
from eagle.sampling import SamplingPolicy, seeded_generator

if TYPE_CHECKING:
    from eagle.bench.builder import Methods

# (owner, attribute, part): the functions timed; owner is a class or an instance
Patch = tuple[object, str, str]


@dataclass
class Timers:
    """Accumulated seconds and calls per part. Only the outermost timed call counts: a timed
    function called from inside another (the policy's `probs` inside the children's sampling)
    is part of its caller's time, so the parts never overlap."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cuda: bool = False
    _depth: int = 0

    def wrap(self, fn: Callable, part: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1
                self._depth -= 1
        return timed


@contextmanager
def timed(patches: Iterable[Patch], timers: Timers):
    """Replace each `owner.attribute` by a timed version for the duration of the block."""
    saved = []
    try:
        for owner, attr, part in patches:
            saved.append((owner, attr, vars(owner).get(attr)))
            setattr(owner, attr, timers.wrap(getattr(owner, attr), part))
        yield timers
    finally:
        for owner, attr, own in reversed(saved):
            if own is not None:
                setattr(owner, attr, own)
            else:  # it came from the class: drop the instance's timed copy
                delattr(owner, attr)


DRAFT_PARTS = ("drafter: FC + decoder layer", "drafter: LM head", "children: top-k / sampling",
               "drafter: mask + positions", "drafter: cache ops")
VERIFY_PARTS = (
    "target: tree forward",
    "target: logits processing",
    "acceptance",
    "target: KV compaction",
)


def round_breakdown(
    timers: Timers, rounds: int, draft_s: float, verify_s: float, passes: int
) -> dict:
    """Milliseconds per round of every part, the bookkeeping left over, and per drafter pass."""
    ms = {
        part: 1000 * timers.seconds.get(part, 0.0) / rounds
        for part in (*DRAFT_PARTS, *VERIFY_PARTS)
    }
    draft_ms, verify_ms = 1000 * draft_s / rounds, 1000 * verify_s / rounds
    ms["drafting: Python bookkeeping"] = draft_ms - sum(ms[p] for p in DRAFT_PARTS)
    ms["verification: Python bookkeeping"] = verify_ms - sum(ms[p] for p in VERIFY_PARTS)
    per_pass = {p: ms[p] * rounds / max(passes, 1) for p in DRAFT_PARTS[:2]}
    return {
        "rounds": rounds,
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "round_ms": draft_ms + verify_ms,
        "drafter_passes_per_round": passes / rounds,
        "parts_ms": ms,
        "drafter_pass_ms": sum(per_pass.values()),
        "drafter_pass_parts_ms": per_pass,
        "calls": dict(timers.calls),
    }


def round_patches(eagle, compiled: bool = False) -> list[Patch]:
    """What `profile_round` times in an EAGLE method (a template proposer over a drafter): its
    drafter's passes, head, children's choice, mask building and cache bookkeeping, and the
    target's tree forward, logits processing, acceptance and KV compaction. Compiled, the
    drafter's whole passes are timed (a timer inside one would break its graph)."""
    import eagle.decoding.engine as engine
    from eagle.proposers.template import TemplateProposer

    if not isinstance(eagle.proposer, TemplateProposer):
        raise ValueError("profile: the eagle method must be a template proposer")
    model = eagle.proposer.model
    if compiled:
        inside = [
            (model, "_scores", "drafter: FC + decoder layer"),
            (model, "_scores_fixed", "drafter: FC + decoder layer"),
        ]
    else:
        inside = [
            (model.drafter, "forward", "drafter: FC + decoder layer"),
            (model.cache, "prepare", "drafter: mask + positions"),
        ]
    return [
        *inside,
        (model.drafter, "logits", "drafter: LM head"),
        (eagle.proposer, "_choose", "children: top-k / sampling"),
        (model.cache, "keep", "drafter: cache ops"),
        (model.cache, "reserve", "drafter: cache ops"),
        (eagle.runner, "verify", "target: tree forward"),
        (SamplingPolicy, "probs", "target: logits processing"),
        (engine, "verify_tree_greedy", "acceptance"),
        (engine, "verify_tree_stochastic", "acceptance"),
        (eagle.runner, "commit", "target: KV compaction"),
    ]


def profile_round(
    eagle,
    dtype: str,
    vanillas: Mapping[str, object],
    prompts: Sequence[list[int]],
    new_tokens: int,
    policy: SamplingPolicy,
    seed: int = 0,
    device: str | torch.device = "cpu",
    compiled: bool = False,
) -> dict:
    """EAGLE's round split into its parts, beside vanilla decoding's step. `eagle` runs in
    `dtype`; `vanillas` holds vanilla decoding in that dtype (the parts' yardstick) and in any
    other to compare with (dtype -> method). Every method warms up, then decodes every prompt
    in turns, prompt by prompt, without timers (the speedups: on a GPU each timer
    synchronises); then EAGLE decodes them again with every part timed (`round_patches`).
    Returns the profile's figures: EAGLE's breakdown (`round_breakdown`, with its tau and the
    round without timers), each vanilla's step, and EAGLE's speedup over its dtype's vanilla
    and over the fastest."""
    if dtype not in vanillas:
        raise ValueError(f"profile_round: no vanilla decoding in eagle's dtype {dtype}")
    patches = round_patches(eagle, compiled)

    def decode_all(runs: dict) -> dict[str, DecodeStats]:
        """Every prompt with each method, in turns prompt by prompt (a drift of the machine's
        load reaches them alike)."""
        out = {name: DecodeStats(prompt_len=0) for name in runs}
        for ids in progress(prompts, desc=f"profile: {', '.join(runs)}", unit="prompt"):
            for name, method in runs.items():
                out[name].rounds += method.generate(
                    ids, new_tokens, policy, seeded_generator(seed, device)
                ).stats.rounds
        return out

    for method in (*vanillas.values(), eagle):
        warm_up(method, prompts, new_tokens, policy, seeded_generator(seed, device))
    plain = decode_all({**{f"vanilla ({d})": v for d, v in vanillas.items()}, "eagle": eagle})
    bare = plain.pop("eagle")
    plain = {d: plain[f"vanilla ({d})"] for d in vanillas}
    timers = Timers(cuda=str(device).startswith("cuda"))
    with timed(patches, timers):  # the breakdown: the same decodes again, every part timed
        spec = decode_all({"eagle (timed)": eagle})["eagle (timed)"]
    passes = timers.calls.get(
        "drafter: FC + decoder layer", 0
    )  # (compiled: mask building included)
    breakdown = round_breakdown(timers, len(spec.rounds), spec.draft_s, spec.verify_s, passes)
    breakdown["tau"] = spec.tau
    steps = {
        d: 1000 * (p.draft_s + p.verify_s) / len(p.rounds) for d, p in plain.items()
    }  # ms per token
    step_ms, fastest = steps[dtype], min(steps, key=steps.get)
    untimed_round_ms = 1000 * (bare.draft_s + bare.verify_s) / len(bare.rounds)
    breakdown["untimed_round_ms"] = untimed_round_ms  # the timers' own cost is round_ms - this
    eagle_ms = untimed_round_ms / bare.tau  # per token
    return {
        "vanilla": {"step_ms": step_ms},
        "vanilla_by_dtype": {d: {"step_ms": ms} for d, ms in steps.items()},
        "eagle": breakdown,
        "speedup": step_ms / eagle_ms,
        "fastest_vanilla": fastest,
        "speedup_vs_fastest": steps[fastest] / eagle_ms,
    }


def breakdown_markdown(report: dict) -> str:
    """The profile as Markdown: one table of parts per round, then the ratios that matter."""
    lines = ["| part | ms per round | share of round |", "|---|---:|---:|"]
    b = report["eagle"]
    for part, ms in b["parts_ms"].items():
        lines.append(f"| {part} | {ms:.2f} | {ms / b['round_ms']:.0%} |")
    lines.append(
        f"| **round** (draft {b['draft_ms']:.2f} + verify {b['verify_ms']:.2f}) | "
        f"{b['round_ms']:.2f} | |"
    )
    if "untimed_round_ms" in b:
        lines.append(
            f"| round without the timers (the speedups' round) | {b['untimed_round_ms']:.2f} | |"
        )
    v = report["vanilla"]
    layer_ms = v["step_ms"] / report["target_layers"]
    lines += [
        "",
        f"- {report['method']}, {report['dtype']}, {report['threads']} threads, "
        f"{report['prompts']} prompts x "
        f"{report['new_tokens']} tokens; tree {report['tree']} ({report['tree_nodes']} nodes)",
        f"- tau {b['tau']:.2f}; vanilla step {v['step_ms']:.2f} ms; speedup "
        f"{report['speedup']:.2f}x; "
        f"speedup / tau {report['speedup'] / b['tau']:.2f}",
        *(
            [
                f"- against the faster vanilla ({report['fastest_vanilla']}, "
                f"{report['vanilla_by_dtype'][report['fastest_vanilla']]['step_ms']:.2f} ms per "
                "token): "
                f"{report['speedup_vs_fastest']:.2f}x"
            ]
            if len(report.get("vanilla_by_dtype", {})) > 1
            else []
        ),
        f"- drafter pass (FC + layer + LM head) {b['drafter_pass_ms']:.2f} ms = "
        f"{b['drafter_pass_ms'] / layer_ms:.1f} target layers (a vanilla step / "
        f"{report['target_layers']} "
        f"layers = {layer_ms:.2f} ms); {b['drafter_passes_per_round']:.1f} passes per round",
        f"- verifying {report['tree_nodes'] + 1} tokens: "
        f"{b['parts_ms']['target: tree forward']:.2f} ms = "
        f"{b['parts_ms']['target: tree forward'] / v['step_ms']:.2f} vanilla steps",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ProfileConfig:
    """configs/decode.yaml's `profile` section."""

    eval_set: str
    num_prompts: int
    new_tokens: int
    temperature: float
    dtype: str  # auto: the benchmark's choice for eagle on this machine
    out_dir: str | Path


def run_profile(methods: Methods, pc: ProfileConfig, seed: int = 0) -> Path:
    """Where EAGLE's round goes (`profile_round`), with the methods `methods` builds: drafting
    and verification split into their parts, beside a vanilla step of the same target. Writes
    profile.json and profile.md; returns their folder."""
    dtype = methods.dtype("eagle", {} if pc.dtype == "auto" else {"eagle": pc.dtype})
    target, tokenizer = methods.target(dtype)
    eagle = methods.build("eagle", dtype)
    # vanilla in EAGLE's dtype (the parts' yardstick) and, on a CPU, in fp32 too: EAGLE's
    # speedup is also reported against the faster one (a bf16 one-token step can be the slower)
    cpu = torch.device(methods.device).type == "cpu"
    dtypes = dict.fromkeys((dtype, "float32") if cpu else (dtype,))
    vanillas = {d: methods.build("vanilla", d) for d in dtypes}
    prompts = [encode_prompt(tokenizer, p) for p in load_eval_set(pc.eval_set, pc.num_prompts)]
    figures = profile_round(
        eagle,
        dtype,
        vanillas,
        prompts,
        pc.new_tokens,
        SamplingPolicy(temperature=pc.temperature),
        seed=seed,
        device=methods.device,
        compiled=bool(methods.compile_mode),
    )
    report = {
        "method": "eagle",
        "dtype": dtype,
        "device": str(methods.device),
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "new_tokens": pc.new_tokens,
        "temperature": pc.temperature,
        "tree": methods.sections["eagle"].get("tree"),
        "tree_nodes": eagle.proposer.max_nodes,
        "target_layers": int(target.config.num_hidden_layers),
        **figures,
    }
    return write_report(pc.out_dir, "profile", report, breakdown_markdown(report))

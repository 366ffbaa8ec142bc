"""Coverage of self-distilled samples by small speculative models (SSMs): the criterion of
SpecInfer's collective boost-tuning and its report.

A sample (a row of `eagle.data.distill`: a prompt and the target's continuation) is *covered*
by an SSM when the SSM's greedy next token equals the target's (`target_argmax`) on at least
`threshold` of the continuation's positions: there the SSM's drafts are accepted under greedy
verification. Boost-tuning trains SSM k on the samples SSMs 1..k-1 do not cover; a set of SSMs
covers a sample when any of them does (the merged tree holds each SSM's draft).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from eagle.artifacts import write_report
from eagle.data.distill import load_distilled, split_rows
from eagle.data.distill import target_argmax as argmax_next  # any LM's argmax after each position
from eagle.progress import progress
from eagle.target import load_target


@dataclass(frozen=True)
class CoverCriterion:
    """When an SSM covers a sample."""

    threshold: float = 0.5  # share of continuation positions where the SSM's argmax is the target's

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"coverage threshold must be in (0, 1], got {self.threshold}")


def agreement(model: nn.Module, input_ids: Tensor, target_argmax: Tensor, prompt_len: int,
              batch_size: int = 32) -> Tensor:
    """Per sample, the share of continuation positions where `model`'s argmax next token is the
    target's.

    Args:
        model: a causal LM sharing the target's tokenizer.
        input_ids: (N, T) prompt + continuation.
        target_argmax: (N, T) the target's argmax next token after each position.
        prompt_len: positions before the continuation; position prompt_len - 1 (the prompt's
            last token) predicts the first continuation token, and so on to the last position.
    Returns:
        (N,) float agreement in [0, 1].
    """
    if input_ids.shape != target_argmax.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and target_argmax {tuple(target_argmax.shape)} "
            "differ"
        )
    if not 0 < prompt_len <= input_ids.shape[1]:
        raise ValueError(f"prompt_len {prompt_len} outside the rows' length {input_ids.shape[1]}")
    out = []
    for i in range(0, len(input_ids), batch_size):
        guess = argmax_next(model, input_ids[i : i + batch_size])[
            :, prompt_len - 1 :
        ]  # (b, T - prompt_len + 1)
        want = target_argmax[i : i + batch_size, prompt_len - 1 :].to(guess.device)
        out.append((guess == want).float().mean(-1).cpu())
    return torch.cat(out)


def covered(agree: Tensor, criterion: CoverCriterion) -> Tensor:
    """(N,) bool: the samples whose agreement reaches the threshold."""
    return agree >= criterion.threshold


def coverage_report(
    agree: Mapping[str, Tensor],
    boosted: Sequence[str],
    baseline: str | None,
    criterion: CoverCriterion,
) -> dict:
    """Per-model coverage and mean agreement, the boosted set's union coverage, and how it
    compares with the baseline (one SSM trained on all the data for the same budget).

    Args:
        agree: model name -> (N,) agreement on the same held-out samples.
        boosted: the boost-tuned SSMs' names, in order.
        baseline: the baseline's name, or None.
    """
    models = {
        name: {
            "coverage": float(covered(a, criterion).float().mean()),
            "mean_agreement": float(a.mean()),
        }
        for name, a in agree.items()
    }
    union = torch.stack([covered(agree[n], criterion) for n in boosted]).any(0)
    # what each SSM adds: samples it covers that none of the SSMs before it covers
    new = []
    seen = torch.zeros_like(union)
    for n in boosted:
        c = covered(agree[n], criterion)
        new.append(float((c & ~seen).float().mean()))
        seen |= c
    report = {
        "threshold": criterion.threshold,
        "samples": int(union.numel()),
        "models": models,
        "boosted": list(boosted),
        "union_coverage": float(union.float().mean()),
        "added_by_each": dict(zip(boosted, new)),
    }
    if baseline is not None:
        base = models[baseline]["coverage"]
        report["baseline"] = baseline
        report["union_beats_baseline"] = report["union_coverage"] > base
    return report


def coverage_markdown(report: dict) -> str:
    """The report as a Markdown table, with its verdict in words."""
    lines = [
        f"Coverage of {report['samples']} held-out self-distilled samples (covered: the model's "
        "argmax "
        f"is the target's on >= {report['threshold']:.0%} of the continuation)",
        "",
        "| model | coverage | mean agreement | new coverage |",
        "|---|---:|---:|---:|",
    ]
    for name, m in report["models"].items():
        added = report["added_by_each"].get(name)
        lines.append(
            f"| {name} | {m['coverage']:.1%} | {m['mean_agreement']:.3f} | "
            f"{'' if added is None else f'{added:.1%}'} |"
        )
    lines.append(
        f"| union of {', '.join(report['boosted'])} | {report['union_coverage']:.1%} | | |"
    )
    if "baseline" in report:
        verdict = "beats" if report["union_beats_baseline"] else "does NOT beat"
        lines += [
            "",
            f"The union {verdict} the {report['baseline']} "
            f"({report['union_coverage']:.1%} vs "
            f"{report['models'][report['baseline']]['coverage']:.1%}).",
        ]
    return "\n".join(lines) + "\n"


def measure_coverage(
    distill_dir: str | Path,
    ssms: Sequence[str],
    baseline: str | None,
    threshold: float,
    out_dir: str | Path,
    also: Sequence[str] = (),
    device: str = "cpu",
) -> Path:
    """SpecInfer's boost-tuning report: each SSM's coverage of the held-out rows of the
    self-distilled data in `distill_dir`, the union of the boost-tuned `ssms` (model folders, in
    boost-tuning order) and the `baseline` (one SSM trained on all rows for the same budget;
    None: none), with more models to report in `also`. Writes coverage.json and coverage.md."""
    criterion = CoverCriterion(threshold)
    _, splits = load_distilled(distill_dir)
    ids, argmax, prompt_len = split_rows(splits["validation"], f"{distill_dir} validation")
    boosted = {f"ssm_{k + 1}": str(p) for k, p in enumerate(ssms)}
    base = f"baseline ({Path(str(baseline)).parent.name})" if baseline else None
    models = {
        **boosted,
        **({base: str(baseline)} if base else {}),
        **{Path(str(p)).parent.name: str(p) for p in also},
    }
    agree = {}
    for name, path in progress(models.items(), desc="coverage", unit="model"):
        model, _ = load_target(path, dtype=torch.float32, device=device, with_tokenizer=False)
        agree[name] = agreement(model, ids, argmax, prompt_len)
    report = coverage_report(agree, list(boosted), base, criterion)
    report["paths"] = models
    return write_report(out_dir, "coverage", report, coverage_markdown(report))

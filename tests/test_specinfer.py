"""SpecInfer's collective boost-tuning and merge, end to end on tiny models: the coverage
criterion and report, the data module that leaves out covered rows, SSM training from a draft
LM (`experiment=ssm_boost`), the `specinfer_merge` method (greedy output identical to vanilla
decoding), and the coverage mode of decode.py. The merge's exactness is in tests/test_merge.py
and tests/test_conformance.py."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from decode import decode
from eagle.bench.methods import MethodContext, MethodError, build_method
from eagle.data.coverage import (
    CoverCriterion,
    agreement,
    coverage_markdown,
    coverage_report,
    covered,
)
from eagle.data.distill import load_distilled
from eagle.sampling import SamplingPolicy
from eagle.target import load_target
from eagle.training.datamodules import DistilledDataModule
from helpers.configs import compose_config, compose_train
from helpers.models import TREES, save_tiny_target
from train import train

# the draft LM's shape (draft_dir), stated: an SSM's model_config instead of init_from's own
SMALL_LM = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                tie_word_embeddings=False)


def model_config(**changes) -> str:
    """`SMALL_LM` with `changes` as a Hydra override of model.model_config."""
    fields = ",".join(f"{k}:{str(v).lower() if isinstance(v, bool) else v}"
                      for k, v in {**SMALL_LM, **changes}.items())
    return f"model.model_config={{{fields}}}"


# ------------------------------------------------------------------------------ coverage


def test_coverage_report_by_hand():
    agree = {"a": torch.tensor([0.9, 0.1, 0.2, 0.6]), "b": torch.tensor([0.1, 0.8, 0.3, 0.7]),
             "all": torch.tensor([0.6, 0.6, 0.1, 0.1])}
    crit = CoverCriterion(0.5)
    assert covered(agree["a"], crit).tolist() == [True, False, False, True]
    rep = coverage_report(agree, ["a", "b"], "all", crit)
    assert rep["models"]["a"]["coverage"] == 0.5 and rep["models"]["all"]["coverage"] == 0.5
    assert rep["union_coverage"] == 0.75  # samples 0, 1, 3
    assert rep["added_by_each"] == {"a": 0.5, "b": 0.25}  # b adds sample 1 only
    assert rep["union_beats_baseline"] is True
    md = coverage_markdown(rep)
    assert "| union of a, b | 75.0% |" in md and "beats the all (75.0% vs 50.0%)" in md
    rep = coverage_report(agree, ["a"], "all", crit)
    assert rep["union_beats_baseline"] is False and "does NOT beat" in coverage_markdown(rep)
    with pytest.raises(ValueError, match="threshold"):
        CoverCriterion(0.0)


def test_agreement_is_one_for_the_target_itself(distilled_dir, target_dir):
    _, splits = load_distilled(distilled_dir)
    ids, argmax = (
        torch.tensor(splits["train"]["input_ids"]),
        torch.tensor(splits["train"]["target_argmax"]),
    )
    target, _ = load_target(target_dir, dtype=torch.float32)
    assert torch.equal(agreement(target, ids, argmax, 8, batch_size=5), torch.ones(len(ids)))
    other = argmax.clone()
    other[:3, 7:] = (
        other[:3, 7:] + 1
    ) % 50  # the target disagrees with itself on every position of 3 rows
    assert agreement(target, ids, other, 8)[:3].tolist() == [0.0] * 3
    with pytest.raises(ValueError, match="prompt_len"):
        agreement(target, ids, argmax, 0)


# ------------------------------------------------------------------------ boost-tuning


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir) -> Path:
    """A 'draft LM' of the shape the SSM configs build (SMALL_LM, two layers), another random init.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    return save_tiny_target(
        tmp_path_factory.mktemp("draft"),
        tok,
        seed=5,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def noisy_dir(tmp_path_factory, target_dir) -> Path:
    """The target with noise on its weights: it agrees with the target on some positions only."""
    model, tok = load_target(target_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("noisy")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def datamodule(distilled_dir, target_dir, covered_by=(), threshold=0.5):
    dm = DistilledDataModule(
        distilled_dir, target_dir, batch_size=4, covered_by=covered_by, threshold=threshold
    )
    dm.setup()
    return dm


def test_rows_covered_by_earlier_ssms_are_left_out(distilled_dir, target_dir, noisy_dir):
    full = datamodule(distilled_dir, target_dir)
    assert full.rows["train"].shape == (24, 16) and full.describe()["train_rows"] == 24
    _, splits = load_distilled(distilled_dir)
    ids, argmax = (
        torch.tensor(splits["train"]["input_ids"]),
        torch.tensor(splits["train"]["target_argmax"]),
    )
    noisy, _ = load_target(noisy_dir, dtype=torch.float32)
    agree = agreement(noisy, ids, argmax, 8)
    threshold = float(agree.median())  # about half the rows covered
    kept = datamodule(distilled_dir, target_dir, [str(noisy_dir)], threshold)
    want = ids[agree < threshold]
    assert 0 < len(want) < 24 and torch.equal(kept.rows["train"], want)
    assert len(kept.rows["validation"]) == 6  # validation keeps every row
    with pytest.raises(ValueError, match="cover every training row"):
        datamodule(distilled_dir, target_dir, [str(target_dir)])  # the target covers all its rows


def ssm_overrides(tmp_path, distilled_dir, target_dir, draft_dir, task, *extra):
    """experiment=ssm_boost (SmolLM2's), on the tiny target's rows and draft LM."""
    return [
        "experiment=ssm_boost",
        f"task_name={task}",
        f"paths.runs_dir={tmp_path}",
        f"data.datamodule.distill_dir={distilled_dir}",
        f"data.datamodule.tokenizer_path={target_dir}",
        f"model.init_from={draft_dir}",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "check_baseline=false",
        "trainer.enable_progress_bar=false",
        *extra,
    ]


@pytest.mark.parametrize("shape", ["init_from's", "stated"])
def test_ssm_boost_trains_from_the_draft_lm(tmp_path, distilled_dir, target_dir, draft_dir, shape):
    """The SSM's shape: the draft LM's own config (model_config null, as ssm_boost says), or
    stated in model_config, which the draft LM's weights fit."""
    extra = [model_config()] if shape == "stated" else []
    cfg = compose_train(
        ssm_overrides(tmp_path, distilled_dir, target_dir, draft_dir, "ssm_1", *extra)
    )
    metrics = train(cfg)
    assert metrics["steps"] == 6
    ssm, _ = load_target(tmp_path / "ssm_1" / "model", dtype=torch.float32)
    draft, _ = load_target(draft_dir, dtype=torch.float32)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(ssm.state_dict().values(), draft.state_dict().values())
    ]
    assert any(moved)
    # fine-tuned, not trained from scratch: the weights stay near the draft LM's
    delta = max(
        (a - b).abs().max().item()
        for a, b in zip(ssm.state_dict().values(), draft.state_dict().values())
    )
    assert delta < 0.1
    sidecar = json.loads((tmp_path / "ssm_1" / "model" / "eagle_target.json").read_text())
    assert sidecar["corpus"].startswith("self-distilled:") and sidecar["train_rows"] == 24


def test_init_from_a_model_of_another_shape_is_refused(
    tmp_path, distilled_dir, target_dir, draft_dir
):
    cfg = compose_train(
        ssm_overrides(
            tmp_path,
            distilled_dir,
            target_dir,
            draft_dir,
            "ssm_bad",
            model_config(num_hidden_layers=3),
        )
    )
    with pytest.raises(ValueError, match="do not fit model_config"):
        train(cfg)


# ------------------------------------------------------------------- the method and report


def test_specinfer_merge_method_is_exact_greedy(target_dir, draft_dir):
    target, tok = load_target(target_dir, dtype=torch.float32)
    loaded = {}

    def draft_lm(path):
        return loaded.setdefault(
            path, load_target(path, dtype=torch.float32, with_tokenizer=False)[0]
        )

    ctx = MethodContext(
        target=target,
        tokenizer=tok,
        target_path=str(target_dir),
        draft_lm=draft_lm,
        tree_dirs=(str(TREES),),
    )
    sections = {
        "specinfer": {"models": [str(draft_dir), str(target_dir)], "tree": "chain5", "budget": 8}
    }
    merge = build_method("specinfer_merge", ctx, sections)
    assert merge.lossless and merge.proposer.max_nodes == 8
    vanilla = build_method("vanilla", ctx, {})
    greedy = SamplingPolicy()
    for prompt in ([5, 9, 12], [40, 41, 42, 43, 44]):
        out = merge.generate(prompt, 30, greedy)
        assert out.tokens == vanilla.generate(prompt, 30, greedy).tokens
        assert out.tau > 1.5  # the target drafting as the second SSM: merged paths are accepted
    with pytest.raises(MethodError, match="needs its SSMs"):
        build_method("specinfer_merge", ctx, {"specinfer": {"models": []}})


def test_coverage_mode_writes_the_report(tmp_path, distilled_dir, target_dir, draft_dir):
    out = tmp_path / "coverage"
    cfg = compose_config(
        "decode",
        [
            "mode=coverage",
            f"target={target_dir}",
            f"coverage.distill_dir={distilled_dir}",
            f"specinfer.models=[{draft_dir},{target_dir}]",
            f"coverage.baseline={draft_dir}",
            f"coverage.out_dir={out}",
            "coverage.threshold=0.5",
        ],
    )
    decode(cfg)
    rep = json.loads((out / "coverage.json").read_text())
    assert (
        rep["samples"] == 6 and rep["models"]["ssm_2"]["coverage"] == 1.0
    )  # the target covers its own rows
    base = rep["models"][rep["baseline"]]["coverage"]
    assert rep["baseline"].startswith("baseline (") and rep["union_beats_baseline"] == (base < 1)
    assert rep["union_coverage"] == 1.0
    assert "union of ssm_1, ssm_2" in (out / "coverage.md").read_text()


def test_distilled_rows_feed_the_feature_dump(tmp_path, distilled_dir, target_dir):
    """data_gen=distilled: EAGLE's features of the target's own text, the loss on its tokens only.
    """
    from data_gen.__main__ import generate as dump_features
    from data_gen.conversations import distilled_samples
    from eagle.data.features import open_feature_dump

    _, tok = load_target(target_dir)
    samples = distilled_samples(tok, 64, distilled_dir)
    _, splits = load_distilled(distilled_dir)
    assert [len(samples[s]) for s in ("train", "validation")] == [24, 6]
    first = samples["train"][0]
    assert first["input_ids"].tolist() == splits["train"][0]["input_ids"]
    assert (
        first["loss_mask"].tolist() == [0] * 8 + [1] * 8
    )  # prompt_len 8, then the target's 8 tokens
    assert distilled_samples(tok, 64, distilled_dir, loss_on="all")["train"][0]["loss_mask"].all()
    # the rows are sampled past an EOS: each sample ends at its continuation's first (not its
    # prompt's)
    import eagle.data.distill as distill_module

    eos = tok.eos_token_id
    rows = [
        {"input_ids": [5, 6, 7, 9, eos, 11, eos, 12], "prompt_len": 3},
        {"input_ids": [5, eos, 7, 9, 10], "prompt_len": 3},
        {"input_ids": [5, 6, 7, 9], "prompt_len": 3},
    ]
    crafted = (
        {},
        {
            "train": datasets.Dataset.from_list(rows),
            "validation": datasets.Dataset.from_list(rows[:1]),
        },
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distill_module, "load_distilled", lambda path: crafted)
        cut = distilled_samples(tok, 64, distilled_dir)["train"]
        whole = distilled_samples(tok, 64, distilled_dir, end_at_eos=False)["train"]
    assert [s["input_ids"].tolist() for s in cut] == [
        [5, 6, 7, 9, eos],
        [5, eos, 7, 9, 10],
        [5, 6, 7, 9],
    ]
    assert cut[0]["loss_mask"].tolist() == [0, 0, 0, 1, 1]
    assert [s["input_ids"].tolist() for s in whole] == [r["input_ids"] for r in rows]
    with pytest.raises(ValueError, match="loss_on"):
        distilled_samples(tok, 64, distilled_dir, loss_on="prompt")
    out = tmp_path / "features"
    dump_features(
        compose_config(
            "data_gen",
            [
                "data_gen=distilled",
                f"source.path={distilled_dir}",
                f"target_path={target_dir}",
                f"out_dir={out}",
                "target_dtype=float32",
                "device=cpu",
                "max_len=64",
                "progress=false",
            ],
        )
    )
    meta, dumped = open_feature_dump(out)
    assert len(dumped["train"]) == 24 and len(dumped["validation"]) == 6

"""Self-distillation data (eagle.data.distill, python -m data_gen.distill): continuations follow
the target's own distribution (chi-square against exact enumeration) and greedy ones equal
`generate`; the stored argmax is the target's; a resumed run equals an uninterrupted one; other
settings are refused; a damaged folder fails to load; the Hydra entry point runs end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import eagle.data.distill as distill_module
from data_gen.conversations import text_samples
from data_gen.distill import generate
from eagle.data.distill import (
    DISTILL_META,
    DistillError,
    generate_distilled,
    load_distilled,
    sample_continuations,
    target_argmax,
)
from eagle.sampling import SamplingPolicy, seeded_generator
from eagle.target import load_target
from helpers.configs import compose_config
from helpers.data import sharegpt_file
from helpers.decoding import hf_greedy
from helpers.models import TEXTS, make_tiny_model, small_tokenizer
from helpers.stats import POLICIES, chi2_pvalue, exact_joint

T1 = SamplingPolicy(temperature=1.0)


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize(
    "family,policy_name", [("llama", "t1"), ("llama", "topk"), ("llama", "topp"), ("gemma2", "t1")]
)
def test_continuations_follow_the_targets_distribution(family, policy_name):
    """Two prompts interleaved in batches of 64 rows, 3 tokens each (a prefill and two cached
    steps): the counts of each prompt's continuations match its exact joint distribution.
    Gemma-2 soft-caps its logits (cap 3): p is the capped distribution."""
    policy = POLICIES[policy_name]
    target = make_tiny_model(family, vocab_size=5, seed=3)
    prompts, n, batches, rows = [[1, 3, 2], [4, 0, 1]], 3, 12, 64
    g = seeded_generator(11)
    counts = [{}, {}]
    for _ in range(batches):
        batch = torch.tensor([prompts[i % 2] for i in range(rows)])
        out = sample_continuations(target, batch, n, policy, g)
        assert out.shape == (rows, 3 + n) and torch.equal(out[:, :3], batch)
        for i, row in enumerate(out.tolist()):
            seq = tuple(row[3:])
            counts[i % 2][seq] = counts[i % 2].get(seq, 0) + 1
    runs = batches * rows // 2
    for prompt, seen in zip(prompts, counts):
        expected = exact_joint(target, prompt, policy, n)
        assert set(seen) <= {s for s, p in expected.items() if p > 0}, (
            "sampled a sequence of probability 0"
        )
        pvalue = chi2_pvalue(seen, expected, runs)
        assert pvalue > 1e-3, f"{family}/{policy_name}, prompt {prompt}: chi2 p-value {pvalue:.2e}"


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_greedy_continuations_equal_generate(family):
    """Temperature 0, a batch of 3, past mistral's and gemma2's 16-token sliding window."""
    target = make_tiny_model(family)
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 96, (3, 10), generator=g)
    out = sample_continuations(target, prompts, 12, SamplingPolicy(temperature=0.0), None)
    for row, prompt in zip(out.tolist(), prompts.tolist()):
        assert row[:10] == prompt
        assert row[10:] == hf_greedy(target, prompt, 12, eos=None), family


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_target_argmax_is_the_full_forwards_argmax(family):
    target = make_tiny_model(family)
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = target(ids).logits.argmax(-1)
    got = target_argmax(target, ids)
    assert got.shape == (3, 17) and torch.equal(got, want)


# ------------------------------------------------------------------------- the folder


@pytest.fixture(scope="module")
def tokenizer():
    return small_tokenizer()


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


# 10 train prompts (shards of 4, 4, 2), 3 validation ones of two lengths (grouped in a batch)
PROMPTS = {
    "train": torch.randint(3, 96, (10, 4), generator=torch.Generator().manual_seed(0)).tolist(),
    "validation": [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16, 17]],
}
SETTINGS = dict(new_tokens=5, policy=T1, batch_size=3, shard_size=4, seed=7, progress=False)


def rows(out_dir: Path) -> dict[str, list[dict]]:
    _, splits = load_distilled(out_dir)
    return {s: list(ds) for s, ds in splits.items()}


@pytest.fixture(scope="module")
def complete(tmp_path_factory, model, tokenizer) -> Path:
    """An uninterrupted run."""
    out = tmp_path_factory.mktemp("distill") / "complete"
    generate_distilled(model, tokenizer, PROMPTS, out, **SETTINGS)
    return out


def test_rows_hold_prompt_continuation_and_argmax(complete, model):
    meta, splits = load_distilled(complete)
    assert (
        meta["status"] == "complete"
        and meta["params"]["new_tokens"] == 5
        and meta["params"]["seed"] == 7
    )
    assert meta["tokenizer_hash"] and meta["params"]["target"]["lm_head_sha256"]
    assert {s: meta["splits"][s]["rows"] for s in splits} == {"train": 10, "validation": 3}
    assert [i["name"] for i in meta["splits"]["train"]["shards"]] == [
        "shard-00000",
        "shard-00001",
        "shard-00002",
    ]
    for split, ds in splits.items():
        assert len(ds) == len(PROMPTS[split])
        for prompt, row in zip(PROMPTS[split], ds):
            assert row["prompt_len"] == len(prompt) and row["input_ids"][: len(prompt)] == prompt
            assert len(row["input_ids"]) == len(prompt) + 5 == len(row["target_argmax"])
            assert (
                row["target_argmax"]
                == target_argmax(model, torch.tensor([row["input_ids"]]))[0].tolist()
            )
    # sampled, not greedy: some continuation leaves the argmax path
    assert any(
        r["input_ids"][t + 1] != r["target_argmax"][t]
        for r in splits["train"]
        for t in range(r["prompt_len"] - 1, len(r["input_ids"]) - 1)
    )


def test_an_interrupted_run_resumes_to_the_same_rows(
    tmp_path, complete, model, tokenizer, monkeypatch
):
    out = tmp_path / "resumed"
    real = distill_module.write_shard
    calls = []

    def crash_in_second_shard(*args, **kwargs):
        calls.append(args[2].name)
        if len(calls) == 2:  # the second shard dies after its first batch is on disk

            def on_batch(n):
                raise RuntimeError("simulated crash")

            kwargs["on_batch"] = on_batch
        return real(*args, **kwargs)

    monkeypatch.setattr(distill_module, "write_shard", crash_in_second_shard)
    with pytest.raises(RuntimeError, match="simulated crash"):
        generate_distilled(model, tokenizer, PROMPTS, out, **SETTINGS)
    assert json.loads((out / DISTILL_META).read_text())["status"] == "incomplete"
    assert (out / "train" / "shard-00000").is_dir() and (out / "train" / "shard-00001.tmp").is_dir()
    with pytest.raises(DistillError, match="incomplete"):
        load_distilled(out)

    calls.clear()
    monkeypatch.setattr(
        distill_module, "write_shard", lambda *a, **k: calls.append(a[2].name) or real(*a, **k)
    )
    meta = generate_distilled(model, tokenizer, PROMPTS, out, **SETTINGS)
    assert calls == ["shard-00001", "shard-00002", "shard-00000"]  # train 1, 2, then validation 0
    assert meta["status"] == "complete" and meta["counts"]["shards_reused"] == 1
    assert not (out / "train" / "shard-00001.tmp").exists()
    assert rows(out) == rows(complete)

    def never(*args, **kwargs):
        raise AssertionError("a complete run was redone")

    monkeypatch.setattr(distill_module, "write_shard", never)
    again = generate_distilled(model, tokenizer, PROMPTS, out, **SETTINGS)
    assert again["status"] == "complete" and again["counts"]["shards_reused"] == 4


def test_other_settings_are_refused_unless_overwrite(tmp_path, complete, model, tokenizer):
    out = tmp_path / "copy"
    shutil.copytree(complete, out)
    with pytest.raises(DistillError, match=r"other settings \(differs in \['seed'\]\).*overwrite"):
        generate_distilled(model, tokenizer, PROMPTS, out, **{**SETTINGS, "seed": 8})
    other_prompts = {**PROMPTS, "validation": PROMPTS["validation"][:2]}
    with pytest.raises(DistillError, match=r"differs in \['splits'\]"):
        generate_distilled(model, tokenizer, other_prompts, out, **SETTINGS)
    assert rows(out) == rows(complete)  # untouched
    meta = generate_distilled(
        model, tokenizer, PROMPTS, out, **{**SETTINGS, "seed": 8}, overwrite=True
    )
    assert meta["params"]["seed"] == 8 and meta["status"] == "complete"
    new = rows(out)
    assert [r["input_ids"][:4] for r in new["train"]] == PROMPTS["train"]
    assert new["train"] != rows(complete)["train"]  # another seed samples other continuations


def test_continuations_past_the_targets_context_are_refused(tmp_path, tokenizer):
    short = make_tiny_model("llama", max_position_embeddings=8)
    with pytest.raises(
        DistillError, match="5 tokens \\+ new_tokens=5 pass the target's context of 8 positions"
    ):
        generate_distilled(short, tokenizer, PROMPTS, tmp_path / "out", **SETTINGS)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_load_refuses_a_missing_incomplete_or_damaged_folder(tmp_path, complete):
    with pytest.raises(DistillError, match="metadata.json missing"):
        load_distilled(tmp_path / "nowhere")

    incomplete = tmp_path / "incomplete"
    shutil.copytree(complete, incomplete)
    meta = json.loads((incomplete / DISTILL_META).read_text())
    (incomplete / DISTILL_META).write_text(json.dumps({**meta, "status": "incomplete"}))
    with pytest.raises(DistillError, match="incomplete"):
        load_distilled(incomplete)

    deleted = tmp_path / "deleted"
    shutil.copytree(complete, deleted)
    shutil.rmtree(deleted / "train" / "shard-00001")
    with pytest.raises(DistillError, match="shard-00001 is missing"):
        load_distilled(deleted)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(complete, corrupt)
    data = corrupt / "validation" / "shard-00000" / "data.arrow"
    blob = bytearray(data.read_bytes())
    blob[-40] ^= 0xFF  # same size, other bytes
    data.write_bytes(bytes(blob))
    with pytest.raises(DistillError, match="shard-00000 is corrupt"):
        load_distilled(corrupt)

    truncated = tmp_path / "truncated"
    shutil.copytree(complete, truncated)
    data = truncated / "train" / "shard-00002" / "data.arrow"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(DistillError, match="corrupt or partial"):
        load_distilled(truncated)


# --------------------------------------------------------------------------- entry point


def test_entry_point_writes_a_loadable_dataset(tmp_path, target_dir, capsys):
    """prompt_at=start on a text corpus: each prompt is a sample's first tokens."""
    out = tmp_path / "distilled"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(TEXTS))
    overrides = [
        "data_gen=text",
        f"source.path={corpus}",
        "source.val_fraction=0.25",
        "prompt_at=start",
        f"target_path={target_dir}",
        f"out_dir={out}",
        "target_dtype=float32",
        "device=cpu",
        "max_len=32",
        "prompt_len=8",
        "new_tokens=4",
        "num_prompts.train=6",
        "num_prompts.validation=2",
        "shard_size=4",
        "batch_size=2",
        "progress=false",
    ]
    meta = generate(compose_config("distill", overrides))
    assert meta["status"] == "complete" and meta["params"]["policy"] == {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
    }
    printed = capsys.readouterr().out
    assert str(out) in printed and "6 train rows, 2 validation rows" in printed
    _, splits = load_distilled(out)
    model, tokenizer = load_target(target_dir)
    samples = text_samples(
        tokenizer, 32, path=corpus, val_fraction=0.25, max_samples=6, max_val_samples=2
    )
    for split, ds in splits.items():
        assert [r["input_ids"][:8] for r in ds] == [
            s["input_ids"][:8].tolist() for s in samples[split]
        ]
        assert all(
            len(r["input_ids"]) == 12 == len(r["target_argmax"]) and r["prompt_len"] == 8
            for r in ds
        )
    # a second command with the same settings (same prompts, same plan) reuses every shard
    assert generate(compose_config("distill", overrides))["counts"]["shards_reused"] == 3


def test_prompts_at_start_or_before_the_first_reply():
    """prompt_at=start takes a sample's first tokens; prompt_at=reply the tokens that end its first
    user turn (just before the first loss token), every prompt of one length, shorter ones skipped.
    """
    import numpy as np

    from data_gen.distill import prompts_of

    def sample(n, reply_at):
        mask = np.zeros(n, np.int8)
        mask[reply_at:] = 1
        return {"input_ids": np.arange(100, 100 + n, dtype=np.int32), "loss_mask": mask}

    samples = {"train": [sample(20, 9), sample(20, 4), sample(6, 6)], "validation": [sample(12, 5)]}
    assert prompts_of(samples, 5, "start") == {
        "train": [list(range(100, 105))] * 3,
        "validation": [list(range(100, 105))],
    }
    reply = prompts_of(samples, 5, "reply")
    assert reply["train"] == [
        list(range(104, 109))
    ]  # a 4-token first turn and a reply-less sample skipped
    assert reply["validation"] == [list(range(100, 105))]
    with pytest.raises(ValueError, match="prompt_at"):
        prompts_of(samples, 5, "middle")


def test_entry_point_distils_replies_to_sharegpt_prompts(tmp_path, target_dir):
    """The default source: ShareGPT conversations rendered with the chat template; each row's
    prompt ends with the assistant header, so the target's continuation is its own reply."""
    source = sharegpt_file(tmp_path / "src.json", n=8)
    out = tmp_path / "replies"
    _, tokenizer = load_target(target_dir)
    header = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    tail = header[-3:]  # the last tokens of any rendered first turn with its generation prompt
    meta = generate(
        compose_config(
            "distill",
            [
                f"source.path={source}",
                "source.val_fraction=0.25",
                f"target_path={target_dir}",
                f"out_dir={out}",
                "target_dtype=float32",
                "device=cpu",
                "prompt_len=6",
                "new_tokens=4",
                "num_prompts.train=8",
                "num_prompts.validation=8",
                "batch_size=4",
                "progress=false",
            ],
        )
    )
    assert meta["status"] == "complete"
    _, splits = load_distilled(out)
    rows = [r for ds in splits.values() for r in ds]
    assert len(rows) == 8 and all(r["prompt_len"] == 6 and len(r["input_ids"]) == 10 for r in rows)
    assert all(r["input_ids"][3:6] == tail for r in rows)

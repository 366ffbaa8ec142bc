"""Self-distilled chat data (eagle/data/regenerate.py, python -m data_gen.regenerate): the
target's own replies, in a ShareGPT file the feature dump reads, resumable exactly."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen.conversations import ConversationError, iter_sharegpt, sharegpt_samples
from eagle.data.regenerate import RegenerateError, regenerate
from eagle.sampling import SamplingPolicy
from eagle.target import load_target
from helpers.data import PROMPTS, sharegpt_file


def run(target_dir, source, out, **kw):
    model, tokenizer = load_target(target_dir)
    args = dict(max_new_tokens=6, policy=SamplingPolicy(), batch_size=2, progress=False)
    return regenerate(model, tokenizer, iter_sharegpt(source), out, **{**args, **kw})


def test_replies_are_the_targets_own_greedy_text(target_dir, tmp_path):
    """Each reply is what `generate` writes for the rendered prompt alone (batch 1: no padding),
    up to the target's end-of-turn token, and the file reads back as ShareGPT samples whose loss
    covers the replies."""
    source = sharegpt_file(tmp_path / "src.json")
    model, tokenizer = load_target(target_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)[
        0, prompt.shape[1] :
    ].tolist()
    # the 4th token the target writes is made its end-of-turn token: replies stop before it
    model.generation_config.eos_token_id = greedy[3]
    meta = regenerate(
        model,
        tokenizer,
        iter_sharegpt(source),
        tmp_path / "out.jsonl",
        max_new_tokens=6,
        policy=SamplingPolicy(),
        batch_size=1,
        progress=False,
    )
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"c{i}" for i in range(5)]
    first = lines[0]["conversations"]
    assert [t["from"] for t in first] == ["human", "gpt"]  # max_turns=1: the first user turn only
    stop_at = greedy.index(greedy[3])
    assert first[1]["value"] == tokenizer.decode(greedy[:stop_at], skip_special_tokens=True)
    assert lines[0]["cut_replies"] == 0
    assert meta["status"] == "complete" and meta["counts"]["conversations"] == 5
    samples = sharegpt_samples(tokenizer, max_len=64, path=tmp_path / "out.jsonl", val_fraction=0.0)
    assert len(samples["train"]) == 5 and all(s["loss_mask"].sum() > 0 for s in samples["train"])


def test_a_reply_keeps_the_whitespace_the_target_wrote(target_dir):
    """A reply that begins with a space-led token and ends on a line break is stored as written:
    stripped, its first token would re-tokenise as another (" an" -> "an") and the self-distilled
    data would no longer be the target's own tokens."""
    from eagle.data.regenerate import reply_batch

    model, tokenizer = load_target(target_dir)
    written = tokenizer(" the answer\n", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(written) == " the answer\n"
    eos = model.generation_config.eos_token_id
    stop = [eos] if isinstance(eos, int) else list(eos)

    def generate(input_ids, **kwargs):  # the target writes `written`, then its end-of-turn token
        tail = torch.tensor([written + stop[:1]] * input_ids.shape[0])
        return torch.cat([input_ids, tail], dim=1)

    model.generate = generate
    replies, cut = reply_batch(
        model, tokenizer, [[{"role": "user", "content": PROMPTS[0]}]], 8, SamplingPolicy(), stop
    )
    assert replies == [" the answer\n"] and cut == [False]


def test_a_file_of_the_stripping_format_is_not_extended(target_dir, tmp_path):
    """Replies were stripped before eagle-regenerated/2: such a file is refused rather than grown
    with replies of the other kind, and an unfinished one is still refused by the dump."""
    source = sharegpt_file(tmp_path / "src.json")
    out = tmp_path / "old.jsonl"
    run(target_dir, source, out)
    sidecar = out.with_name(out.name + ".json")
    meta = json.loads(sidecar.read_text())
    meta["plan"]["format"], meta["status"] = "eagle-regenerated/1", "incomplete"
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(RegenerateError, match="regenerated with other settings"):
        run(target_dir, source, out)
    with pytest.raises(ConversationError, match="unfinished regeneration"):
        list(iter_sharegpt(out))


def test_several_turns_answer_the_targets_own_history(target_dir, tmp_path):
    source = sharegpt_file(tmp_path / "src.json", n=3)
    meta = run(target_dir, source, tmp_path / "out.jsonl", max_turns=2, batch_size=3)
    record = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    speakers = [t["from"] for t in record["conversations"]]
    assert speakers == ["human", "gpt", "human", "gpt"]
    assert record["conversations"][2]["value"] == "and then?"
    assert "someone else" not in json.dumps(record)  # every reply is the target's
    assert meta["counts"]["replies"] == 6


def test_source_replies_keep_the_same_conversations_and_cut_alike(target_dir, tmp_path):
    """replies="source" (a data ablation's control): the conversations and turns a regeneration
    keeps, with the source's own replies cut at max_new_tokens of the target's tokens; a kept turn
    the source leaves unanswered ends the conversation there (none left: skipped and counted)."""
    source = sharegpt_file(tmp_path / "src.json", n=4)
    records = json.loads(source.read_text())
    records[1]["conversations"] = records[1]["conversations"][:3]  # its second turn is unanswered
    # two user turns in a row: its first kept turn is unanswered (a file with no reply at all is
    # never read)
    records[2]["conversations"] = [records[2]["conversations"][0], *records[2]["conversations"][2:]]
    records[3]["conversations"][1]["value"] = " ".join(["word"] * 40)  # a long reply, to be cut
    source.write_text(json.dumps(records))
    _, tokenizer = load_target(target_dir)
    budget = len(
        tokenizer("an answer written by someone else", add_special_tokens=False)["input_ids"]
    )  # kept whole
    regenerated = run(target_dir, source, tmp_path / "own.jsonl", max_turns=2)
    meta = run(
        target_dir,
        source,
        tmp_path / "src.jsonl",
        max_turns=2,
        max_new_tokens=budget,
        replies="source",
    )
    lines = [json.loads(line) for line in (tmp_path / "src.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == ["c0", "c1", "c3"]
    assert regenerated["counts"]["conversations"] == 4  # the target answers every kept turn
    assert [t["value"] for t in lines[0]["conversations"]] == [
        records[0]["conversations"][0]["value"],
        "an answer written by someone else",
        "and then?",
        "more",
    ]
    assert [t["from"] for t in lines[1]["conversations"]] == [
        "human",
        "gpt",
    ]  # up to the unanswered turn
    cut = lines[2]["conversations"][1]["value"]
    assert len(tokenizer(cut, add_special_tokens=False)["input_ids"]) <= budget and cut.startswith(
        "word"
    )
    assert len(cut) < len(records[3]["conversations"][1]["value"])
    assert lines[2]["cut_replies"] == 1 and meta["counts"]["cut_replies"] == 1
    assert meta["counts"]["unanswered_skipped"] == 1 and meta["plan"]["replies"] == "source"
    assert "replies" not in regenerated["plan"]  # a regeneration's plan is unchanged by the option
    with pytest.raises(RegenerateError, match="replies must be"):
        run(target_dir, source, tmp_path / "x.jsonl", replies="human")


def test_an_interrupted_run_resumes_to_the_same_file(target_dir, tmp_path):
    """Sampled at T=1 with batches of 2: a crash that left 1.5 batches on disk, then a rerun,
    gives the uninterrupted file byte for byte."""
    source = sharegpt_file(tmp_path / "src.json")
    policy = SamplingPolicy(temperature=1.0)
    whole = tmp_path / "whole.jsonl"
    run(target_dir, source, whole, policy=policy)
    lines = whole.read_text().splitlines(keepends=True)
    crashed = tmp_path / "crashed.jsonl"
    run(target_dir, source, crashed, policy=policy)
    crashed.write_text("".join(lines[:3]) + lines[3][:10])  # batch 2 incomplete, its last line cut
    meta = run(target_dir, source, crashed, policy=policy)
    assert crashed.read_bytes() == whole.read_bytes()
    assert meta["counts"]["conversations"] == 5
    from itertools import islice

    grown = tmp_path / "grown.jsonl"  # 3 conversations, then 5: the file is extended, not redone
    model, tokenizer = load_target(target_dir)
    args = dict(max_new_tokens=6, policy=policy, batch_size=2, progress=False)
    regenerate(model, tokenizer, islice(iter_sharegpt(source), 3), grown, **args)
    assert len(grown.read_text().splitlines()) == 3
    regenerate(model, tokenizer, iter_sharegpt(source), grown, **args)
    assert grown.read_bytes() == whole.read_bytes()
    other = run(target_dir, source, tmp_path / "seed1.jsonl", policy=policy, seed=1)
    assert (tmp_path / "seed1.jsonl").read_bytes() != whole.read_bytes() and other[
        "status"
    ] == "complete"


def test_other_settings_and_foreign_files_are_refused(target_dir, tmp_path):
    source = sharegpt_file(tmp_path / "src.json")
    out = tmp_path / "out.jsonl"
    run(target_dir, source, out)
    with pytest.raises(RegenerateError, match="other settings"):
        run(target_dir, source, out, max_new_tokens=7)
    out.with_name("out.jsonl.json").write_text(
        '{"plan": {"format"'
    )  # a sidecar a crash cut: overwrite mends it
    run(target_dir, source, out, max_new_tokens=7, overwrite=True)
    assert json.loads(out.with_name("out.jsonl.json").read_text())["plan"]["max_new_tokens"] == 7
    with pytest.raises(RegenerateError, match="not written by a regeneration"):
        run(target_dir, source, source)  # never overwrites the user's own file
    assert json.loads(source.read_text())[0]["id"] == "c0"
    with pytest.raises(RegenerateError, match="must be >= 1"):
        run(target_dir, source, tmp_path / "x.jsonl", batch_size=0)


def test_long_prompts_are_skipped_and_counted(target_dir, tmp_path):
    source = sharegpt_file(tmp_path / "src.json")
    meta = run(target_dir, source, tmp_path / "out.jsonl", max_prompt_tokens=1)
    assert meta["counts"]["long_prompts_skipped"] == 5 and meta["counts"]["conversations"] == 0


def test_the_entry_point_writes_the_file(target_dir, tmp_path):
    from data_gen.regenerate import generate
    from helpers.configs import compose_config

    source = sharegpt_file(tmp_path / "src.json")
    meta = generate(
        compose_config(
            "regenerate",
            [
                f"target_path={target_dir}",
                f"source.path={source}",
                f"out_path={tmp_path / 'r.jsonl'}",
                "max_new_tokens=4",
                "max_conversations=3",
                "device=cpu",
                "target_dtype=float32",
                "progress=false",
                "batch_size=2",
            ],
        )
    )
    assert (
        meta["counts"]["conversations"] == 3
        and len((tmp_path / "r.jsonl").read_text().splitlines()) == 3
    )


def test_an_unfinished_file_is_refused_by_the_dump_and_a_finished_one_rerun_says_so(
    target_dir, tmp_path, caplog
):
    """A dump of a regenerated file its run has not finished would train on part of it as if it
    were whole; a finished run rerun samples its short last batch again without calling it the
    remains of an interrupted run, and the file stays the same."""
    source = sharegpt_file(tmp_path / "src.json")  # 5 conversations: batches of 2, 2 and 1
    out = tmp_path / "out.jsonl"
    run(target_dir, source, out)
    whole = out.read_bytes()
    _, tokenizer = load_target(target_dir)
    assert len(sharegpt_samples(tokenizer, max_len=64, path=out)["train"]) > 0
    sidecar = out.with_name("out.jsonl.json")
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(
        json.dumps({"plan": meta["plan"], "status": "incomplete"})
    )  # what a stopped run leaves
    out.write_bytes(b"".join(whole.splitlines(keepends=True)[:2]))
    with pytest.raises(ConversationError, match="unfinished regeneration.*rerun"):
        sharegpt_samples(tokenizer, max_len=64, path=out)
    run(target_dir, source, out)  # resumes
    assert out.read_bytes() == whole and json.loads(sidecar.read_text())["status"] == "complete"
    caplog.clear()
    with caplog.at_level("INFO", logger="eagle.data.regenerate"):
        run(target_dir, source, out)
    assert out.read_bytes() == whole
    assert "interrupted" not in caplog.text and "last, short batch" in caplog.text


def test_a_rerun_asking_for_fewer_leaves_a_finished_file_finished(target_dir, tmp_path):
    from itertools import islice

    source = sharegpt_file(tmp_path / "src.json")
    out = tmp_path / "out.jsonl"
    run(target_dir, source, out)
    whole, sidecar = out.read_bytes(), out.with_name("out.jsonl.json").read_text()
    model, tokenizer = load_target(target_dir)
    with pytest.raises(RegenerateError, match="more than the 2 asked for"):
        regenerate(
            model,
            tokenizer,
            islice(iter_sharegpt(source), 2),
            out,
            max_new_tokens=6,
            policy=SamplingPolicy(),
            batch_size=2,
            progress=False,
        )
    assert out.read_bytes() == whole and out.with_name("out.jsonl.json").read_text() == sidecar

"""Self-distilled chat data: the target rewrites the assistant replies of ShareGPT conversations.

EAGLE's answer to a drafter whose training data does not match its target: keep the data's
prompts and let the target answer them, so the drafter learns the distribution it will have to
predict. `regenerate` takes conversations (`{"id", "messages"}`, as `data_gen.conversations`
reads them), keeps each one's first `max_turns` user turns (with a system message if it has
one), and lets the target write every reply in turn, each given the replies it wrote before,
sampled under a `SamplingPolicy` (greedy at temperature 0) up to `max_new_tokens` or the end of
its turn. The output is a ShareGPT JSONL file, so the usual feature dump reads it like the
original (`python -m data_gen source.path=<file>`: chat template, loss on the replies).

`replies="source"` writes the source's own replies instead, cut at `max_new_tokens` of the
target's tokens, for exactly the conversations and turns a regeneration keeps: the control of a
data ablation (same prompts, same reply budget; only who wrote the replies differs). A conversation
whose kept user turn has no reply in the source is skipped and counted.

Generation is Hugging Face's batched `generate` with left padding (`batch_size` conversations
at once); a reply cut at `max_new_tokens` is kept and counted. Batch b is sampled after
`torch.manual_seed(seed + b)` (generate draws from torch's default generator), so its replies
depend only on the plan and the batch, never on what ran before.

Resuming. Each finished batch is appended to the file and synced; `<file>.json` records the
plan (target, policy, sizes, source), whether the file is complete, and its counts. A rerun with
the same plan keeps the whole batches already written (what a crash left of a batch is dropped
and that batch sampled again) and goes on; a different plan is refused unless `overwrite=True`.
How many conversations are asked for is not part of the plan: a rerun with more extends the file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle.progress import progress as progress_bar
from eagle.sampling import SamplingPolicy
from eagle.target import TargetIdentity

log = logging.getLogger(__name__)

# /2: replies kept as written, whitespace included (/1 stripped them): a /1 file is not extended in
# /2
FORMAT = "eagle-regenerated/2"
SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt"}  # back to ShareGPT's names


class RegenerateError(ValueError):
    """A regenerated file made with other settings, or settings that cannot work."""


def user_turns(messages: list[dict], max_turns: int) -> tuple[list[dict], list[str]]:
    """(system messages, the first `max_turns` user contents) of a conversation."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"][:max_turns]
    return system, users


def source_replies(messages: list[dict], max_turns: int) -> list[str]:
    """The source's assistant reply to each of the first `max_turns` user turns, up to the first
    user turn that has none (a conversation that ends on a user turn)."""
    out: list[str] = []
    for i, m in enumerate(messages):
        if m["role"] != "user" or len(out) == max_turns:
            continue
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        if nxt is None or nxt["role"] != "assistant":
            break
        out.append(nxt["content"])
    return out


def cut_reply(tokenizer, text: str, max_new_tokens: int) -> tuple[str, bool]:
    """`text` cut at `max_new_tokens` of the tokenizer's tokens, and whether it was cut."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_new_tokens:
        return text, False
    return tokenizer.decode(ids[:max_new_tokens], skip_special_tokens=True), True


def to_sharegpt(
    cid: str, system: list[dict], users: list[str], replies: list[str], cut: int
) -> dict:
    """One regenerated conversation as a ShareGPT record (`cut_replies`: replies that reached
    max_new_tokens before their end-of-turn token)."""
    turns = [{"from": SPEAKERS["system"], "value": m["content"]} for m in system]
    for user, reply in zip(users, replies):
        turns += [
            {"from": SPEAKERS["user"], "value": user},
            {"from": SPEAKERS["assistant"], "value": reply},
        ]
    return {"id": cid, "conversations": turns, "cut_replies": cut}


def _stop_ids(model: nn.Module, tokenizer) -> list[int]:
    """The tokens that end a reply: the generation config's EOS ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise RegenerateError(
            "the target names no end-of-turn token (generation_config.eos_token_id): replies "
            "would never end"
        )
    return ids


@torch.inference_mode()
def reply_batch(
    model: nn.Module,
    tokenizer,
    chats: list[list[dict]],
    max_new_tokens: int,
    policy: SamplingPolicy,
    stop: list[int],
) -> tuple[list[str], list[bool]]:
    """The target's next reply to each chat (left-padded, one `generate`); returns the texts and
    whether each was cut at `max_new_tokens` (no end-of-turn token)."""
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats
    ]
    rows = tokenizer(texts, add_special_tokens=False)[
        "input_ids"
    ]  # the template wrote its own specials
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    # left padding: every prompt ends at the same column, where generation starts
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)  # (B, L)
    mask = torch.tensor(
        [[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device
    )  # (B, L)
    sampling = policy.temperature > 0
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        eos_token_id=stop,
        pad_token_id=pad,
        **(
            {
                "temperature": policy.temperature,
                "top_k": policy.top_k or 0,
                "top_p": policy.top_p or 1.0,
            }
            if sampling
            else {"temperature": None, "top_k": None, "top_p": None}
        ),
    )
    new = out[:, width:]  # (B, <= max_new_tokens)
    replies, cut = [], []
    for row in new.tolist():
        ends = [i for i, t in enumerate(row) if t in stop]
        cut.append(not ends)
        # as written, whitespace included: a reply the target begins with a space-led token keeps
        # it, so the dump's tokens are the target's own (stripped, they would start on another
        # token)
        replies.append(tokenizer.decode(row[: ends[0]] if ends else row, skip_special_tokens=True))
    return replies, cut


def _whole_batches(path: Path, batch_size: int) -> tuple[int, int, int]:
    """(conversations in whole batches, the bytes they take, lines past them) of a JSONL file. A
    batch an interrupted run left incomplete (or a last line it cut) is sampled again from its
    own seed; so is a finished run's last batch, short because its source ran out, so that a run
    asked for more extends the file as one run would have written it."""
    if not path.exists():
        return 0, 0, 0
    data = path.read_bytes()
    lines = data[: data.rfind(b"\n") + 1].splitlines(keepends=True)
    done = len(lines) // batch_size * batch_size
    cut_line = int(not data.endswith(b"\n") and bool(data))  # a last line an interrupted write cut
    return done, len(b"".join(lines[:done])), len(lines) - done + cut_line


def _count(path: Path) -> dict[str, int]:
    """Conversations, replies and replies cut at max_new_tokens in a regenerated file."""
    counts = {"conversations": 0, "replies": 0, "cut_replies": 0}
    with path.open() as f:
        for line in f:
            record = json.loads(line)
            counts["conversations"] += 1
            counts["replies"] += sum(
                t["from"] == SPEAKERS["assistant"] for t in record["conversations"]
            )
            counts["cut_replies"] += record["cut_replies"]
    return counts


def regenerate(
    model: nn.Module,
    tokenizer,
    conversations: Iterable[dict],
    out_path: str | Path,
    max_new_tokens: int,
    policy: SamplingPolicy,
    batch_size: int = 8,
    max_turns: int = 1,
    max_prompt_tokens: int = 1024,
    seed: int = 0,
    source: Any = None,
    overwrite: bool = False,
    progress: bool = True,
    total: int | None = None,
    replies: str = "target",
) -> dict:
    """Write the target's replies to `conversations` (or with `replies="source"` the source's own,
    cut alike) as ShareGPT JSONL to `out_path` (see the module docstring); returns the plan
    sidecar's contents with its counts."""
    if max_new_tokens < 1 or batch_size < 1 or max_turns < 1:
        raise RegenerateError(
            f"max_new_tokens, batch_size and max_turns must be >= 1, got {max_new_tokens}, "
            f"{batch_size}, {max_turns}"
        )
    if replies not in ("target", "source"):
        raise RegenerateError(
            f"replies must be 'target' (the target writes them) or 'source' (the source's own), "
            f"got {replies!r}"
        )
    from_source = replies == "source"

    out_path = Path(out_path)
    meta_path = out_path.with_name(out_path.name + ".json")
    ident = TargetIdentity.of(model, tokenizer)
    plan = {
        "format": FORMAT,
        "target": ident.to_dict(),
        "max_new_tokens": max_new_tokens,
        "policy": {"temperature": policy.temperature, "top_k": policy.top_k, "top_p": policy.top_p},
        "batch_size": batch_size,
        "max_turns": max_turns,
        "max_prompt_tokens": max_prompt_tokens,
        "seed": seed,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "source": source,
    }
    if (
        from_source
    ):  # no sampling: the policy, seed and dtype play no part (the key is absent for "target",
        # so files regenerated before the option existed keep their plan)
        plan.update(replies="source", policy=None, seed=None, dtype=None)
    finished = False  # the file's run ended (its last batch may be short: the source ran out)
    if out_path.exists() and not overwrite:
        if not meta_path.exists():
            raise RegenerateError(
                f"{out_path} exists and was not written by a regeneration (no {meta_path.name}); "
                f"use another file or overwrite=true"
            )
        previous = json.loads(meta_path.read_text())
        if previous.get("plan") != plan:
            raise RegenerateError(
                f"{out_path} was regenerated with other settings ({meta_path}); use another "
                f"file or overwrite=true"
            )
        finished = previous.get("status") == "complete"
    elif out_path.exists():
        out_path.unlink()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done, keep_bytes, past = _whole_batches(out_path, batch_size)
    long_prompts = no_reply = 0
    stop = None if from_source else _stop_ids(model, tokenizer)
    # counts every conversation read from the source (`total` of them are asked for), skipped ones
    # too
    desc = "copying the source's replies" if from_source else "regenerating replies"
    bar = progress_bar(total=total, desc=desc, unit="conv", disable=not progress)

    def usable() -> Iterator[tuple[str, list[dict], list[str], list[str]]]:
        nonlocal long_prompts, no_reply
        for conv in conversations:
            system, users = user_turns(conv["messages"], max_turns)
            if not users:
                bar.update()
                continue
            answers: list[str] = []
            if from_source:
                answers = source_replies(conv["messages"], max_turns)
                users = users[: len(answers)]  # the turns the source answers
                if not users:
                    no_reply += 1
                    bar.update()
                    continue
            first = tokenizer.apply_chat_template(
                system + [{"role": "user", "content": users[0]}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )  # token ids
            if len(first) > max_prompt_tokens:
                long_prompts += 1
                bar.update()
                continue
            yield conv["id"], system, users, answers

    items = usable()
    skipped = sum(
        1 for _ in islice(items, done)
    )  # the batches a previous run wrote (the plan fixes their order)
    bar.update(skipped)
    if skipped < done:
        raise RegenerateError(
            f"{out_path} holds {done} conversations, more than the {skipped} asked for now "
            f"(or than the source holds)"
        )
    # the file is not whole from here until the run ends: a feature dump refuses it meanwhile
    # (data_gen.conversations.check_finished)
    meta_path.write_text(json.dumps({"plan": plan, "status": "incomplete"}, indent=2) + "\n")
    if out_path.exists() and out_path.stat().st_size != keep_bytes:
        if finished:
            log.info("%s: sampling its last, short batch again (%d line(s))", out_path, past)
        else:
            log.warning(
                "%s: dropping %d line(s) of a batch an interrupted run left incomplete",
                out_path,
                past,
            )
        with out_path.open("r+b") as f:
            f.truncate(keep_bytes)
    with out_path.open("a") as f:
        b = done // batch_size
        while batch := list(islice(items, batch_size)):
            torch.manual_seed(seed + b)  # generate samples from torch's default generator
            chats = [list(system) for _, system, _, _ in batch]
            written: list[list[str]] = [[] for _ in batch]
            cut = [0] * len(batch)
            for turn in range(max(len(users) for _, _, users, _ in batch)):
                rows = [i for i, (_, _, users, _) in enumerate(batch) if turn < len(users)]
                for i in rows:
                    chats[i].append({"role": "user", "content": batch[i][2][turn]})
                if from_source:
                    texts, was_cut = zip(
                        *(cut_reply(tokenizer, batch[i][3][turn], max_new_tokens) for i in rows)
                    )
                else:
                    texts, was_cut = reply_batch(
                        model, tokenizer, [chats[i] for i in rows], max_new_tokens, policy, stop
                    )
                for i, text, c in zip(rows, texts, was_cut):
                    chats[i].append({"role": "assistant", "content": text})
                    written[i].append(text)
                    cut[i] += c
            for (cid, system, users, _), reply, c in zip(batch, written, cut):
                f.write(json.dumps(to_sharegpt(cid, system, users, reply, c)) + "\n")
            f.flush()
            os.fsync(
                f.fileno()
            )  # a batch is on disk before the next starts: a crash loses at most one
            bar.update(len(batch))
            b += 1
    bar.close()
    counts = {**_count(out_path), "long_prompts_skipped": long_prompts}
    if from_source:
        counts["unanswered_skipped"] = no_reply
    if counts["cut_replies"]:
        log.warning(
            "%s: %d of %d replies reached max_new_tokens=%d before their end of turn (kept, cut)",
            out_path,
            counts["cut_replies"],
            counts["replies"],
            max_new_tokens,
        )
    meta = {"plan": plan, "status": "complete", "counts": counts}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta

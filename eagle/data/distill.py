"""Self-distillation data: the target writes the sequences a drafter is trained on.

EAGLE trains its drafter on fixed data whose continuations were written by someone else; a
drafter trained on the target's *own* outputs learns the distribution it will have to predict
at decode time. `generate_distilled` takes prompts (token ids), lets the target continue each
one by `new_tokens` tokens sampled under a `SamplingPolicy` (temperature, top-k, top-p; greedy
at temperature 0), and stores every row with the target's argmax after each position.

Layout (`out_dir`):

    metadata.json                 what produced it and what it holds (an eagle.artifacts sidecar)
    train/shard-00000/data.arrow  Arrow stream file: `datasets.Dataset.from_file` reads it
    train/shard-00000/shard.json  rows, tokens, bytes and sha256 of data.arrow
    validation/shard-00000/...

Each row: `input_ids` (int32 list: the prompt followed by its continuation), `prompt_len`
(int32) and `target_argmax` (int32 list, as long as `input_ids`: the target's argmax next
token after each position, from one full forward of the row). Rows keep the prompts' order;
prompt i of a split is in shard `i // shard_size`.

Fixed-length rows: generation does *not* stop at EOS. A continuation that samples EOS goes
on sampling after it (the target's distribution after an EOS, usually a new document), so
every row of a split with equal prompt lengths has the same length; a trainer that wants
documents to end at EOS masks what follows it.

Sampling: batched, with a KV cache; p is the target's own distribution (`eagle.target`'s
head and logit transform, so Gemma-2's soft-cap and Cohere's scale are honoured) after the
policy (`SamplingPolicy.probs`), and tokens are drawn with `SamplingPolicy.sample`.

Resuming. Shard s of a split is sampled with its own generator, seeded from (seed, split, s)
on the target's device, so its rows depend only on the plan (target, dtype, device type,
policy, seed, new_tokens, shard_size, batch_size, prompts), never on what ran before. Each
shard is written into `shard-XXXXX.tmp/` and renamed when complete; a rerun keeps complete
shards and redoes the rest, so an interrupted-then-resumed run holds exactly the rows of an
uninterrupted one. `batch_size` is part of the plan: the random stream is consumed step by
step across a batch's rows, so another batch size draws other (equally distributed) rows.
A folder made with another plan is refused unless `overwrite=True`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eagle.artifacts import SPLITS, Artifact
from eagle.data import shards
from eagle.data.shards import shard_ranges
from eagle.decoding.kv_cache import new_cache
from eagle.progress import progress as progress_bar
from eagle.sampling import SamplingPolicy, argmax, check_generator, seeded_generator
from eagle.target import TargetIdentity, context_length, head_logits, target_forward

log = logging.getLogger(__name__)

FORMAT = "eagle-distill/1"
DISTILL_META = "metadata.json"
REDO = "; delete that shard folder and rerun the distillation with the same settings to redo it"


class DistillError(ValueError):
    """A distilled-data folder that is missing, incomplete, corrupt or made with other settings."""


# --------------------------------------------------------------------------- sampling


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def sample_continuations(
    target: nn.Module,
    prompts: torch.Tensor,
    new_tokens: int,
    policy: SamplingPolicy,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Continue each prompt by `new_tokens` tokens sampled from the target.

    Args:
        target: the causal LM, in eval mode, on the device to compute on.
        prompts: (B, L) long token ids, all the same length (no padding).
        new_tokens: tokens to sample per row; generation does not stop at EOS.
        policy: temperature / top-k / top-p; greedy (argmax, nothing drawn) at temperature 0.
        generator: RNG on the target's device (`eagle.sampling.seeded_generator`), or None.
    Returns:
        (B, L + new_tokens) long, on the target's device: the prompts, then their continuations.
    """
    if prompts.dim() != 2 or prompts.size(1) < 1:
        raise ValueError(f"prompts must be (B, L) with L >= 1, got shape {tuple(prompts.shape)}")
    if new_tokens < 0:
        raise ValueError(f"new_tokens must be >= 0, got {new_tokens}")
    device = _device(target)
    check_generator(generator, device)
    ids = prompts.to(device, torch.long)
    if new_tokens == 0:
        return ids.clone()
    cache = new_cache(ids.shape[1] + new_tokens)
    out = target_forward(
        target, ids, cache, logits_slice=slice(-1, None)
    )  # prefill: logits (B, 1, V)
    tokens = []
    for step in range(new_tokens):
        probs = policy.probs(out.logits[:, -1])  # (B, V): p after the policy
        token = policy.sample(probs, generator)  # (B,)
        tokens.append(token)
        if step + 1 < new_tokens:
            out = target_forward(
                target, token[:, None], cache
            )  # one step; positions follow the cache
    return torch.cat([ids, torch.stack(tokens, dim=1)], dim=1)


@torch.inference_mode()
def target_argmax(target: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The target's argmax next token after each position of `ids`, from one forward.

    Args:
        ids: (B, T) token ids (no padding).
    Returns:
        (B, T) long on the target's device; column t is the argmax of p(. | ids[:, :t + 1]).
        The LM head runs row by row, so a large vocabulary needs only T x V logits at a time.
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be (B, T), got shape {tuple(ids.shape)}")
    device = _device(target)
    # features for every position; the head below, per row (logits_slice: none here)
    features = target_forward(
        target, ids.to(device, torch.long), logits_slice=slice(0, 0)
    ).features  # (B, T, H)
    return torch.stack([argmax(head_logits(target, features[i])) for i in range(features.size(0))])


def split_rows(dataset, where: str = "") -> tuple[torch.Tensor, torch.Tensor, int]:
    """A split's rows as tensors: input_ids (N, T), target_argmax (N, T) and their prompt length,
    which must be one for all rows (whole-row training and coverage need aligned continuations)."""
    columns = dataset.select_columns(["input_ids", "target_argmax", "prompt_len"]).to_dict()
    lengths = {len(r) for r in columns["input_ids"]}
    prompt_lens = sorted(set(columns["prompt_len"]))
    if len(lengths) != 1 or len(prompt_lens) != 1:
        raise DistillError(
            f"{where}: rows of lengths {sorted(lengths)} and prompt lengths {prompt_lens}; one of "
            f"each is needed (distil with equal prompt lengths)"
        )
    return (
        torch.tensor(np.asarray(columns["input_ids"], dtype=np.int64)),
        torch.tensor(np.asarray(columns["target_argmax"], dtype=np.int64)),
        int(prompt_lens[0]),
    )


# ------------------------------------------------------------------------------ plan


def prompts_fingerprint(prompts: Sequence[Sequence[int]]) -> str:
    """sha256 over the prompts' ids: equal fingerprints, same prompts in the same order."""
    h = hashlib.sha256()
    for p in prompts:
        a = np.asarray(p, dtype=np.int64)
        h.update(np.int64(a.size).tobytes())
        h.update(a.tobytes())
    return h.hexdigest()


def shard_seed(seed: int, split: str, shard: int) -> int:
    """The seed of shard `shard` of `split`: a hash of the three, so shards draw independent
    streams."""
    digest = hashlib.sha256(f"eagle-distill:{seed}:{split}:{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def row_schema():
    """The `datasets.Features` of a shard; its Arrow schema carries them as metadata."""
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "prompt_len": datasets.Value("int32"),
            "target_argmax": datasets.List(datasets.Value("int32")),
        }
    )


# ---------------------------------------------------------------------------- writing


def _batch_rows(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    policy: SamplingPolicy,
    generator: torch.Generator | None,
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, target_argmax) of each prompt, in order; prompts of equal length are sampled
    together (a batch normally holds one length; mixed lengths are grouped in order of appearance).
    """
    device = _device(target)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if len(p) < 1:
            raise ValueError(f"prompt {i} of the batch is empty")
        groups.setdefault(len(p), []).append(i)
    rows: list[Any] = [None] * len(prompts)
    for members in groups.values():
        batch = torch.tensor([list(prompts[i]) for i in members], dtype=torch.long, device=device)
        ids = sample_continuations(target, batch, new_tokens, policy, generator)  # (b, L + n)
        argmax = target_argmax(target, ids)  # (b, L + n)
        for j, i in enumerate(members):
            rows[i] = (ids[j].tolist(), argmax[j].tolist())
    return rows


def write_shard(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    shard_dir: Path,
    *,
    new_tokens: int,
    policy: SamplingPolicy,
    generator: torch.Generator | None,
    batch_size: int,
    plan: str,
    on_batch: Callable[[int], None] | None = None,
) -> dict:
    """Sample and write one shard atomically (`eagle.data.shards.write_shard`).

    `on_batch(n)` is called after each batch of n rows is on disk (progress bar; the tests'
    simulated crash). Returns the shard's info (also written to `shard.json`).
    """

    def batches() -> Iterator[shards.Batch]:
        for a in range(0, len(prompts), batch_size):
            batch = prompts[a : a + batch_size]
            done = _batch_rows(target, batch, new_tokens, policy, generator)
            columns = {
                "input_ids": [np.asarray(ids, np.int32) for ids, _ in done],
                "prompt_len": [len(p) for p in batch],
                "target_argmax": [np.asarray(am, np.int32) for _, am in done],
            }
            yield columns, {"tokens": sum(len(ids) for ids, _ in done)}

    return shards.write_shard(
        shard_dir, row_schema().arrow_schema, batches(), _fingerprint(prompts, plan), on_batch
    )


def _fingerprint(prompts: Sequence[Sequence[int]], plan: str) -> dict[str, str]:
    """What a shard was made from: its prompts and the run's whole plan (`shards.plan_hash`)."""
    return {"prompts_fingerprint": prompts_fingerprint(prompts), "plan": plan}


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def generate_distilled(
    target: nn.Module,
    tokenizer,
    prompts: dict[str, list[list[int]]],
    out_dir: str | Path,
    *,
    new_tokens: int,
    policy: SamplingPolicy,
    batch_size: int = 8,
    shard_size: int = 256,
    seed: int = 0,
    target_path: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Let the target continue `prompts` and write the rows to `out_dir`, resumably.

    Args:
        target: the causal LM, in eval mode, on the device to sample on.
        tokenizer: its tokenizer (its hash goes in the metadata), or None.
        prompts: split ("train", "validation") -> token id lists; a missing split is empty.
        out_dir: the output folder; an existing one with the same plan is resumed.
        new_tokens: tokens sampled after each prompt (no stop at EOS: fixed-length rows).
        policy: the sampling policy; temperature 0 is greedy.
        batch_size: prompts per batch (part of the plan: it orders the random draws).
        shard_size: rows per shard.
        seed: shard s of a split draws from a generator seeded by (seed, split, s).
        target_path: recorded in the metadata.
        overwrite: delete a folder made with another plan (else `DistillError`).
        progress: show progress over the prompts (`eagle.progress`).
    Returns:
        The metadata (also `out_dir/metadata.json`), with "status": "complete".
    """
    unknown = sorted(set(prompts) - set(SPLITS))
    if unknown:
        raise ValueError(f"unknown split(s) {unknown}; prompts are keyed by {list(SPLITS)}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    prompts = {s: [list(map(int, p)) for p in prompts.get(s, [])] for s in SPLITS}
    for split, rows in prompts.items():
        empty = next((i for i, p in enumerate(rows) if not p), None)
        if empty is not None:
            raise ValueError(f"{split} prompt {empty} is empty")
    context, longest = (
        context_length(target),
        max((len(p) for rows in prompts.values() for p in rows), default=0),
    )
    if context is not None and longest + new_tokens > context:
        raise DistillError(
            f"a prompt of {longest} tokens + new_tokens={new_tokens} pass the target's context of "
            f"{context} positions: shorten the prompts or lower new_tokens"
        )
    out_dir = Path(out_dir)
    device = _device(target)
    identity = TargetIdentity.of(target, tokenizer, target_path, with_lm_head=True)
    target_info = identity.to_dict()
    target_info.pop("target_path", None)  # the folder may move
    plan = {  # what decides the rows; a rerun with the same plan resumes
        "format": FORMAT,
        "target": target_info,
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "device_type": device.type,  # CPU and CUDA generators draw different streams
        "new_tokens": int(new_tokens),
        "policy": {
            "temperature": float(policy.temperature),
            "top_k": int(policy.top_k),
            "top_p": float(policy.top_p),
        },
        "seed": int(seed),
        "shard_size": int(shard_size),
        "batch_size": int(batch_size),
        "splits": {
            s: {"prompts": len(prompts[s]), "fingerprint": prompts_fingerprint(prompts[s])}
            for s in SPLITS
        },
    }
    plan_id = shards.plan_hash(plan)
    art = Artifact(out_dir, DISTILL_META, plan, "distilled data")
    shards.start(art, overwrite, DistillError)
    started = time.time()
    art.write(status="incomplete", format=FORMAT)

    every = [
        (split, k, a, b)
        for split in SPLITS
        for k, (a, b) in enumerate(shard_ranges(len(prompts[split]), shard_size))
    ]
    infos: dict[str, list[dict]] = {s: [] for s in SPLITS}
    skipped = 0
    total = sum(b - a for _, _, a, b in every)
    with progress_bar(total=total, desc="distill", unit="sample", disable=not progress) as bar:
        for split, k, a, b in every:
            rows, shard_dir = prompts[split][a:b], out_dir / split / shard_name(k)
            generator = (
                None if policy.greedy else seeded_generator(shard_seed(seed, split, k), device)
            )
            write = partial(
                write_shard,
                target,
                rows,
                shard_dir,
                new_tokens=new_tokens,
                policy=policy,
                generator=generator,
                batch_size=batch_size,
                plan=plan_id,
                on_batch=bar.update,
            )
            info, kept = shards.reuse_or_write(shard_dir, _fingerprint(rows, plan_id), write)
            if kept:
                skipped += 1
                bar.update(b - a)  # written by an earlier run
            infos[split].append(info)
    if skipped:
        log.info("distill: %d of %d shards were complete already (kept)", skipped, len(every))

    splits = {
        s: {
            "rows": sum(i["rows"] for i in infos[s]),
            "tokens": sum(i["tokens"] for i in infos[s]),
            "bytes": sum(i["bytes"] for i in infos[s]),
            "shards": infos[s],
        }
        for s in SPLITS
    }
    return art.write(
        status="complete",
        format=FORMAT,
        target_path=target_path,
        tokenizer_hash=identity.tokenizer_hash,
        rows="input_ids: prompt + continuation (int32); prompt_len; target_argmax: the "
        "target's argmax next token after each position of input_ids (int32, same length)",
        eos="generation does not stop at EOS: fixed-length rows",
        counts={
            "rows": sum(v["rows"] for v in splits.values()),
            "tokens": sum(v["tokens"] for v in splits.values()),
            "shards": len(every),
            "shards_reused": skipped,
        },
        splits=splits,
        seconds_this_run=round(time.time() - started, 2),
    )


# ----------------------------------------------------------------------------- reading


def read_distill_metadata(out_dir: str | Path) -> dict:
    """The metadata of a complete distilled-data folder; `DistillError` otherwise."""
    return shards.read_complete(
        Path(out_dir),
        DISTILL_META,
        FORMAT,
        DistillError,
        "distilled data",
        "python -m data_gen.distill",
    )


def load_distilled(out_dir: str | Path) -> tuple[dict, dict[str, Any]]:
    """The metadata and each split's rows as one `datasets.Dataset` (its shards concatenated, in
    order); every shard's presence, size, sha256 and row count are checked (`DistillError`)."""
    import datasets

    out_dir = Path(out_dir)
    meta = read_distill_metadata(out_dir)
    out = {}
    for split in SPLITS:
        infos = meta.get("splits", {}).get(split, {}).get("shards", [])
        parts = [
            shards.open_shard(out_dir / split / info["name"], info, DistillError, REDO)
            for info in infos
        ]
        if parts:
            out[split] = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        else:
            out[split] = datasets.Dataset.from_dict(
                {k: [] for k in row_schema()}, features=row_schema()
            )
    return meta, out

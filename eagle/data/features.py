"""Dump the target's features for drafter training, as sharded `datasets` Arrow files.

Layout of a dump (`out_dir`):

    metadata.json                   what produced it and what it holds (see below)
    train/shard_00000/data.arrow    Arrow stream file: `datasets.Dataset.from_file` reads it
    train/shard_00000/shard.json    rows, tokens, bytes and sha256 of data.arrow
    train/shard_00001/...
    validation/shard_00000/...

Each row is one sample: `id` (string), `input_ids` (int32 list), `loss_mask` (int8 list),
`length` (int32) and `features`: the raw little-endian bytes of the (T, H) array of the
target's features (the hidden state that feeds its LM head) in the storage dtype named in
`metadata.json` (`features.dtype`). Arrow has no bfloat16: bf16 features are stored as
their 16-bit patterns (a `torch.bfloat16` tensor viewed as int16); `decode_features`
turns the bytes back into a tensor. fp16 and fp32 are stored as themselves.

Resuming. Sample i of a split goes to shard `i // shard_size`, and the sample order is a
function of the source config and the tokenizer only, so a rerun computes the same shards.
Each shard is written into `shard_XXXXX.tmp/` and renamed to `shard_XXXXX/` only once its
file and `shard.json` are complete: a rerun keeps complete shards whose sample fingerprint
matches, and recomputes the rest (a leftover `.tmp` is deleted). `metadata.json` is the
dump's `eagle.artifacts.Artifact` sidecar: the plan as its params, and `"status":
"incomplete"` until the last shard is in.

Loading (`open_feature_dump`) checks the status, the row counts and file sizes of every
shard, optionally their sha256, and the target identity (tokenizer hash, hidden size,
vocabulary, LM head fingerprint), and fails with one clear line otherwise.

Several processes. `dump_features(..., rank=r, world_size=n)` in n processes (GPUs or
machines; `python -m data_gen` takes RANK / WORLD_SIZE from torchrun) split the shards
between them and write one dump, equal to the one a single process writes.
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
from eagle.progress import progress as progress_bar
from eagle.target import TargetIdentity, context_length, embeddings, target_forward

log = logging.getLogger(__name__)

FORMAT = "eagle-features/2"  # 2: the plan is the sidecar's "params" (eagle.artifacts)
METADATA = "metadata.json"
# storage dtype -> (torch dtype of the tensor, numpy dtype of its bytes)
STORAGE = {
    "bfloat16": (torch.bfloat16, np.int16),  # bf16 bit patterns, viewed as int16
    "float16": (torch.float16, np.float16),
    "float32": (torch.float32, np.float32),
}
STORAGE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
REDO = "; delete that shard folder and rerun `python -m data_gen` with the same settings to redo it"


class FeatureDumpError(ValueError):
    """A feature dump that is missing, incomplete, corrupt or made for another target."""


# --------------------------------------------------------------------------- encoding


def storage_dtype(name: str) -> str:
    name = STORAGE_ALIASES.get(name, name)
    if name not in STORAGE:
        raise ValueError(f"unknown feature dtype {name!r}; choose one of {sorted(STORAGE)}")
    return name


def encode_features(features: torch.Tensor, dtype: str) -> bytes:
    """(T, H) tensor -> raw bytes in the storage dtype (bf16 as its int16 bit pattern)."""
    torch_dtype, np_dtype = STORAGE[dtype]
    t = features.detach().to("cpu", torch_dtype).contiguous()
    if torch_dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().astype(np_dtype, copy=False).tobytes()


def decode_features(blob: bytes, length: int, hidden_size: int, dtype: str) -> torch.Tensor:
    """Raw bytes -> (T, H) tensor of the storage dtype (bf16 stays bf16)."""
    torch_dtype, np_dtype = STORAGE[dtype]
    expected = length * hidden_size * np.dtype(np_dtype).itemsize
    if len(blob) != expected:
        raise FeatureDumpError(f"feature row holds {len(blob)} bytes, expected {expected} "
                               f"({length} x {hidden_size} {dtype}): corrupt shard")
    arr = np.frombuffer(blob, dtype=np_dtype).reshape(length, hidden_size).copy()
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else t


def row_schema():
    """The `datasets.Features` of a shard; its Arrow schema carries them as metadata."""
    import datasets

    return datasets.Features({
        "id": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "length": datasets.Value("int32"),
        "features": datasets.Value("large_binary"),  # (length, H) in metadata's dtype
    })


# ---------------------------------------------------------------------------- hashing


def samples_fingerprint(samples: Sequence[dict]) -> str:
    """sha256 over ids, tokens and masks: equal fingerprints, same samples in the same order."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s["id"].encode() + b"\0")
        h.update(np.asarray(s["input_ids"], dtype=np.int32).tobytes())
        h.update(np.asarray(s["loss_mask"], dtype=np.int8).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- writing


def pad_batch(samples: Sequence[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token ids: (B, T) ids and (B, T) attention mask (1 = real token)."""
    t = max(s["input_ids"].size for s in samples)
    ids = torch.full((len(samples), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), t), dtype=torch.long)
    for i, s in enumerate(samples):
        n = s["input_ids"].size
        ids[i, :n] = torch.from_numpy(np.asarray(s["input_ids"], dtype=np.int64))
        mask[i, :n] = 1
    return ids, mask


@torch.inference_mode()
def batch_features(model: nn.Module, samples: Sequence[dict], pad_id: int) -> list[torch.Tensor]:
    """The target's features of each sample, (T_i, H) each, from one padded forward."""
    device = next(model.parameters()).device
    ids, mask = pad_batch(samples, pad_id)  # (B, T) each
    # right padding: with a causal mask no real token attends to a pad, pads are dropped below.
    # No logits (an empty slice): the LM head over every position would add a fifth of a small
    # target's arithmetic (SmolLM2's 49,152 x 576 head) and a (B, T, V) tensor nobody reads.
    feats = target_forward(model, ids.to(device), attention_mask=mask.to(device),
                           logits_slice=slice(0, 0)).features  # (B, T, H)
    return [feats[i, : s["input_ids"].size] for i, s in enumerate(samples)]


def write_shard(model: nn.Module, samples: Sequence[dict], shard_dir: Path, *, batch_size: int,
                dtype: str, pad_id: int, plan: str,
                on_batch: Callable[[int], None] | None = None) -> dict:
    """Compute and write one shard atomically (`eagle.data.shards.write_shard`).

    Batches are formed after sorting the shard's samples by length (less padding); rows are
    written in that order, which depends only on the samples. `on_batch(n)` is called after
    each batch of n rows is on disk (progress bar, and the tests' simulated crash).
    Returns the shard's info (also written to `shard.json`).
    """
    order = sorted(range(len(samples)), key=lambda i: (-samples[i]["input_ids"].size, i))

    def batches() -> Iterator[shards.Batch]:
        for a in range(0, len(order), batch_size):
            batch = [samples[i] for i in order[a : a + batch_size]]
            feats = batch_features(model, batch, pad_id)
            columns = {
                "id": [s["id"] for s in batch],
                "input_ids": [np.asarray(s["input_ids"], np.int32) for s in batch],
                "loss_mask": [np.asarray(s["loss_mask"], np.int8) for s in batch],
                "length": [int(s["input_ids"].size) for s in batch],
                "features": [encode_features(f, dtype) for f in feats],
            }
            yield (
                columns,
                {
                    "tokens": sum(columns["length"]),
                    "loss_tokens": int(sum(int(s["loss_mask"].sum()) for s in batch)),
                },
            )

    return shards.write_shard(
        shard_dir, row_schema().arrow_schema, batches(), _fingerprint(samples, plan), on_batch
    )


def _fingerprint(samples: Sequence[dict], plan: str) -> dict[str, str]:
    """What a shard was made from: its samples and the dump's whole plan (`shards.plan_hash`)."""
    return {"samples_fingerprint": samples_fingerprint(samples), "plan": plan}


def dump_features(
    model: nn.Module,
    tokenizer,
    samples: dict[str, list[dict]],
    out_dir: str | Path,
    *,
    target_path: str | None = None,
    source: dict | None = None,
    max_len: int | None = None,
    shard_size: int = 512,
    batch_size: int = 8,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> dict:
    """Write the features of `samples` (split -> list of samples) to `out_dir`, resumably.

    Several processes (GPUs, machines) write one dump together: each is given `rank` and
    `world_size` and the same samples, computes the shards whose global index (train shards,
    then validation shards) is `rank` modulo `world_size`, and leaves the others alone; the
    process that finds every shard complete when it is done writes the complete metadata.
    Each process resumes its own shards; the result is the dump one process would write.

    Args:
        model: the target, in eval mode, on the device to compute on.
        tokenizer: its tokenizer (its hash goes in the metadata; pad id for batching).
        samples: from `data_gen.conversations` (`{"train": [...], "validation": [...]}`).
        out_dir: the dump folder; an existing dump with the same plan is resumed.
        target_path, source, max_len: recorded in the metadata (what produced the samples).
        shard_size: samples per shard.
        batch_size: samples per target forward.
        dtype: storage dtype of the features, "bfloat16" or "float16" (or "float32").
        overwrite: delete an existing dump that was made with another plan (else an error);
            refused with several processes (one would delete the others' shards).
        progress: show progress (`eagle.progress`: a bar on a terminal, lines in a log).
        rank / world_size: this process's share of the shards.
    Returns:
        The metadata (also in `out_dir/metadata.json`): "complete" once every shard is in.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dtype = storage_dtype(dtype)
    out_dir = Path(out_dir)
    context = context_length(model)
    longest = max((s["input_ids"].size for rows in samples.values() for s in rows), default=0)
    if context is not None and longest > context:
        raise FeatureDumpError(
            f"a sample has {longest} tokens, past the target's context of {context} positions: "
            f"lower max_len to {context} or less"
        )
    rows = embeddings(model).weight.shape[0]
    top = max(
        (
            int(s["input_ids"].max())
            for split in samples.values()
            for s in split
            if s["input_ids"].size
        ),
        default=-1,
    )
    if (
        top >= rows
    ):  # the embedding would fail with a bare IndexError (a device-side assert on a GPU)
        raise FeatureDumpError(
            f"the samples hold token id {top}, past the target's {rows} embedding rows: they were "
            f"tokenised with another tokenizer than the model's; use the tokenizer the target was "
            f"trained with ({target_path or 'the target folder'})"
        )
    identity = TargetIdentity.of(model, tokenizer, target_path, with_lm_head=True)
    hidden = identity.hidden_size
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    target = identity.to_dict()
    target.pop("target_path", None)  # the folder may move
    plan = {  # what decides the content; a rerun with the same plan resumes
        "format": FORMAT,
        "target": target,
        "source": source or {},
        "max_len": max_len,
        "shard_size": shard_size,
        "dtype": dtype,
        # the precision the features are computed in: a resumed dump must not mix two
        "compute": {
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "device_type": next(model.parameters()).device.type,
        },
        "splits": {
            s: {
                "samples": len(samples.get(s, [])),
                "fingerprint": samples_fingerprint(samples.get(s, [])),
            }
            for s in SPLITS
        },
    }
    plan_id = shards.plan_hash(plan)
    dump = Artifact(out_dir, METADATA, plan, "feature dump")
    shards.start(dump, overwrite, FeatureDumpError, several_processes=world_size > 1)
    # a complete dump goes through the loop too: intact shards are skipped, missing ones redone
    started = time.time()
    dump.write(status="incomplete", format=FORMAT)

    # every shard of the dump, in one global order; this process's are every world_size-th
    every = [
        (split, k, a, b)
        for split in SPLITS
        for k, (a, b) in enumerate(shard_ranges(len(samples.get(split, [])), shard_size))
    ]
    mine = [shard for i, shard in enumerate(every) if i % world_size == rank]
    infos: dict[tuple[str, int], dict] = {}
    desc = f"features (rank {rank} of {world_size})" if world_size > 1 else "features"
    total = sum(b - a for _, _, a, b in mine)
    with progress_bar(total=total, desc=desc, unit="sample", disable=not progress) as bar:
        computed = {
            "tokens": 0,
            "since": time.time(),
        }  # the bar's tokens/s: this run's forwards only

        def advance(rows: list[dict], done: list[int], n: int) -> None:
            """n more of `rows` are on disk (written in order): count their tokens."""
            computed["tokens"] += sum(len(r["input_ids"]) for r in rows[done[0] : done[0] + n])
            done[0] += n
            bar.update(n)
            rate = computed["tokens"] / max(time.time() - computed["since"], 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)

        for split, k, a, b in mine:
            rows, shard_dir = samples[split][a:b], out_dir / split / f"shard_{k:05d}"
            write = partial(
                write_shard,
                model,
                rows,
                shard_dir,
                batch_size=batch_size,
                dtype=dtype,
                pad_id=pad_id,
                plan=plan_id,
                on_batch=partial(advance, rows, [0]),
            )
            infos[split, k], kept = shards.reuse_or_write(
                shard_dir, _fingerprint(rows, plan_id), write
            )
            if kept:
                bar.update(b - a)  # done by an earlier run

    def others() -> (
        str | None
    ):  # the other processes' shards: finished yet? (the first missing one)
        for split, k, a, b in every:
            if (split, k) not in infos:
                shard = out_dir / split / f"shard_{k:05d}"
                info = shards.complete_shard(shard, _fingerprint(samples[split][a:b], plan_id))
                if info is None:
                    return str(shard)
                infos[split, k] = info
        return None

    if (missing := others()) is not None:
        incomplete = dump.write(status="incomplete", format=FORMAT)
        # look again after writing "incomplete": the rank that finished meanwhile may have
        # written "complete" before this write, which would otherwise stand over it
        if (missing := others()) is not None:
            log.warning(
                "rank %d of %d: its %d shards are done; the dump is complete once every rank "
                "has finished (%s is not yet)",
                rank,
                world_size,
                len(mine),
                missing,
            )
            return incomplete

    split_info: dict[str, Any] = {}
    for split in SPLITS:
        done = [infos[key] for key in sorted(infos) if key[0] == split]
        split_info[split] = {
            "samples": sum(s["rows"] for s in done),
            "tokens": sum(s["tokens"] for s in done),
            "loss_tokens": sum(s["loss_tokens"] for s in done),
            "bytes": sum(s["bytes"] for s in done),
            "shards": done,
        }

    n_tokens = sum(v["tokens"] for v in split_info.values())
    n_bytes = sum(v["bytes"] for v in split_info.values())
    return dump.write(
        status="complete",
        format=FORMAT,
        target_path=target_path,
        tokenizer_hash=identity.tokenizer_hash,
        hidden_size=hidden,
        features={
            "dtype": dtype,
            "hidden_size": hidden,
            "encoding": "raw little-endian bytes of a (length, hidden_size) array; bfloat16 as "
            "its 16-bit patterns (torch.bfloat16 viewed as int16)",
            "what": "the target's last hidden state, after the final norm (the LM head's input)",
        },
        counts={
            "samples": sum(v["samples"] for v in split_info.values()),
            "tokens": n_tokens,
            "loss_tokens": sum(v["loss_tokens"] for v in split_info.values()),
            "shards": sum(len(v["shards"]) for v in split_info.values()),
            "bytes": n_bytes,
            "bytes_per_token": round(n_bytes / n_tokens, 2) if n_tokens else None,
        },
        splits=split_info,
        seconds_this_run=round(time.time() - started, 2),
    )


# ----------------------------------------------------------------------------- reading


def read_metadata(dump_dir: str | Path) -> dict:
    return shards.read_complete(
        Path(dump_dir), METADATA, FORMAT, FeatureDumpError, "feature dump", "python -m data_gen"
    )


def made_for(meta: dict) -> TargetIdentity:
    """The identity of the target a dump's features came from."""
    return TargetIdentity.from_dict(
        {**meta["params"]["target"], "target_path": meta.get("target_path") or ""}
    )


def verify_shard(shard_dir: Path, info: dict, verify: str = "checksum") -> None:
    """Check one shard against its metadata: presence, size, (sha256)."""
    shards.verify_shard(shard_dir, info, FeatureDumpError, REDO, verify)


class FeatureShards(torch.utils.data.Dataset):
    """The samples of one split of a dump, memory-mapped shard by shard.

    Items: `{"input_ids": long (T,), "loss_mask": long (T,), "features": (T, H) storage dtype}`.
    """

    def __init__(
        self, dump_dir: str | Path, split: str, meta: dict | None = None, verify: str = "checksum"
    ):
        self.dump_dir = Path(dump_dir)
        self.meta = meta if meta is not None else read_metadata(dump_dir)
        self.dtype = self.meta["features"]["dtype"]
        self.hidden_size = int(self.meta["features"]["hidden_size"])
        if split not in self.meta["splits"]:
            raise FeatureDumpError(f"feature dump {dump_dir} has no {split!r} split")
        self.shards = [
            shards.open_shard(
                self.dump_dir / split / info["name"], info, FeatureDumpError, REDO, verify
            )
            for info in self.meta["splits"][split]["shards"]
        ]
        self.offsets = np.cumsum([0] + [len(p) for p in self.shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def token_rows(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row's (input_ids, loss_mask), read from the Arrow columns without decoding a
        feature (`eagle.data.vocab.count_tokens`)."""
        for shard in self.shards:
            table = shard.data  # the Arrow table: list columns, flattened chunk by chunk
            for ids, mask in zip(
                table.column("input_ids").chunks, table.column("loss_mask").chunks, strict=True
            ):
                yield ids.flatten().to_numpy(), mask.flatten().to_numpy()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        row = self.shards[k][int(i - self.offsets[k])]
        n = int(row["length"])
        return {
            "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long),
            "features": decode_features(row["features"], n, self.hidden_size, self.dtype),
        }


def open_feature_dump(
    dump_dir: str | Path, identity: TargetIdentity | None = None, verify: str = "checksum"
) -> tuple[dict, dict[str, FeatureShards]]:
    """Validate a dump (and, given the training target's `identity`, that it came from that
    target: tokenizer, sizes, LM head) and open both splits."""
    meta = read_metadata(dump_dir)
    if identity is not None:
        made_for(meta).check(identity, f"the feature dump {dump_dir}")
    splits = {s: FeatureShards(dump_dir, s, meta, verify) for s in SPLITS if s in meta["splits"]}
    return meta, splits

"""A reduced drafting vocabulary: the K tokens the drafter's training data uses most (FR-Spec).

The drafter's LM head is the target's, V x H. On a small target, or on a CPU, it is a large share
of a drafter pass (SmolLM2's 49,152 x 576 head is a fifth of the target's weights).
FR-Spec (Zhao et al., 2025) drafts from the K most frequent tokens only, so the head costs
K x H. Decoding stays exact: each draft token's proposal q is recorded over those K tokens (zero
elsewhere) and verification corrects any q. What a smaller K loses is acceptance where the
target's next token lies outside it; the coverage (the share of the training data's predicted
tokens inside the K) bounds that loss.

Training writes the counts next to the drafter (`token_counts.safetensors`: `counts`, int64 (V,),
the tokens the drafter learned to predict: loss-masked positions of its training split). For a
drafter trained elsewhere, count a feature dump into its folder:

    python -m eagle.data.vocab --features runs/data/features/<dump> --drafter runs/<run>/drafter
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

COUNTS_NAME = "token_counts.safetensors"


def count_tokens(rows: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> Tensor:
    """How often each token is a predicted token: `rows` are (input_ids, loss_mask) pairs, and a
    token counts where its mask is set (the positions the training loss is taken at).

    Returns:
        counts (V,) int64.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in rows:
        ids = np.asarray(ids, dtype=np.int64)[np.asarray(mask) > 0]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token id {int(ids.max())} outside the vocabulary of {vocab_size}")
        np.add.at(counts, ids, 1)  # O(row), not O(V): rows are many and short, vocabularies large
    return torch.from_numpy(counts)


def draft_vocabulary(counts: Tensor, k: int) -> tuple[Tensor, float]:
    """The K most frequent tokens (ties: the lower id first), sorted by id, and their coverage:
    the share of all counted tokens they hold.

    Returns:
        ids (K,) long, coverage in [0, 1].
    """
    vocab = counts.numel()
    if not 1 <= k <= vocab:
        raise ValueError(
            f"a draft vocabulary of {k} tokens: choose 1..{vocab} (the target's vocabulary)"
        )
    # a stable descending sort keeps the lower id first among equal counts
    order = torch.sort(counts, descending=True, stable=True).indices[:k]
    total = int(counts.sum())
    coverage = float(counts[order].sum()) / total if total else 0.0
    return order.sort().values, coverage


def save_counts(dir: str | Path, counts: Tensor) -> Path:
    """Write `counts` (V,) into the checkpoint folder `dir` (atomically)."""
    from safetensors.torch import save_file

    from eagle.models.checkpoint import write_atomic

    path = Path(dir) / COUNTS_NAME
    write_atomic(
        path, lambda tmp: save_file({"counts": counts.to(torch.int64).contiguous()}, str(tmp))
    )
    return path


def load_counts(dir: str | Path, vocab_size: int | None = None) -> Tensor | None:
    """The counts saved in checkpoint folder `dir`, or None when it has none; checked against
    `vocab_size` when given."""
    from eagle.models.checkpoint import CheckpointError, read_safetensors

    path = Path(dir) / COUNTS_NAME
    if not path.exists():
        return None
    counts = read_safetensors(path).get("counts")
    if counts is None or counts.dim() != 1 or counts.dtype != torch.int64:
        raise CheckpointError(f"{path} must hold `counts`, a 1-D int64 tensor")
    if vocab_size is not None and counts.numel() != vocab_size:
        raise CheckpointError(
            f"{path} counts {counts.numel()} tokens, the target's vocabulary has {vocab_size}"
        )
    return counts


def main(argv: list[str] | None = None) -> None:
    from eagle.data.features import FeatureShards, made_for, read_metadata

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--features", type=Path, required=True, help="a feature dump (python -m data_gen)"
    )
    parser.add_argument(
        "--drafter", type=Path, required=True, help="the checkpoint folder to write the counts into"
    )
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    if not args.drafter.is_dir():
        raise SystemExit(f"--drafter {args.drafter} is not a checkpoint folder")
    from eagle.models.checkpoint import CheckpointError, load_drafter_config
    from eagle.target import TargetIdentity, TargetMismatchError

    meta = read_metadata(args.features)
    # the counts index the target's vocabulary: a dump of another target's (another tokenizer's ids,
    # another size) would replace the drafter's counts with meaningless ones
    try:
        target = load_drafter_config(args.drafter).target
    except CheckpointError as err:
        raise SystemExit(f"error: {err}") from None
    if not target:
        raise SystemExit(
            f"--drafter {args.drafter}: its config.json names no target to check the dump against"
        )
    try:
        made_for(meta).check(
            TargetIdentity.from_dict(target), f"the feature dump {args.features}", head="warn"
        )
    except TargetMismatchError as err:
        raise SystemExit(f"error: {err}; the drafter's counts are left as they were") from None
    shards = FeatureShards(args.features, args.split, meta, verify="size")
    counts = count_tokens(shards.token_rows(), made_for(meta).vocab_size)
    print(f"{int(counts.sum())} predicted tokens counted -> {save_counts(args.drafter, counts)}")


if __name__ == "__main__":
    main()

"""A reduced drafting vocabulary (FR-Spec): the counts, the K tokens chosen from them, the drafter's
reduced head, and the counts training writes. Exactness of drafting from it (greedy and sampled,
every runner and family): tests/test_conformance.py (`eagle_vocab`); through decode.py:
tests/test_methods.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle.data.features import FeatureShards
from eagle.data.vocab import (
    COUNTS_NAME,
    count_tokens,
    draft_vocabulary,
    load_counts,
    main,
    save_counts,
)
from eagle.decoding import SpeculativeDecoder
from eagle.models.checkpoint import CheckpointError, save_drafter
from eagle.models.drafter import DrafterConfig, EagleDrafter
from eagle.proposers import eagle_proposer
from eagle.sampling import SamplingPolicy
from eagle.target import load_target
from helpers.decoding import tree
from helpers.models import make_tiny_model, save_tiny_target, small_tokenizer


def test_counts_are_the_predicted_tokens():
    rows = [(np.array([3, 1, 3, 0]), np.array([0, 1, 1, 1])), (np.array([2, 3]), np.array([1, 0]))]
    assert count_tokens(rows, 5).tolist() == [1, 1, 1, 1, 0]  # the unmasked 3s are not predicted
    with pytest.raises(ValueError, match="outside the vocabulary of 3"):
        count_tokens(rows, 3)


def test_the_k_most_counted_tokens_sorted_by_id_with_their_coverage():
    counts = torch.tensor([5, 0, 9, 5, 1, 0])
    ids, coverage = draft_vocabulary(counts, 3)
    assert ids.tolist() == [0, 2, 3] and coverage == pytest.approx(19 / 20)
    assert draft_vocabulary(counts, 2)[0].tolist() == [0, 2]  # a tie goes to the lower id
    assert draft_vocabulary(counts, 6)[1] == 1.0
    for k in (0, 7):
        with pytest.raises(ValueError, match="choose 1..6"):
            draft_vocabulary(counts, k)


def test_counts_round_trip_and_bad_files_are_named(tmp_path):
    assert load_counts(tmp_path) is None
    save_counts(tmp_path, torch.tensor([4, 0, 2]))
    assert load_counts(tmp_path, 3).tolist() == [4, 0, 2]
    with pytest.raises(CheckpointError, match="counts 3 tokens, the target's vocabulary has 5"):
        load_counts(tmp_path, 5)
    (tmp_path / COUNTS_NAME).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_counts(tmp_path)


def test_the_reduced_head_scores_its_tokens_as_the_whole_head_does():
    # soft-capped logits: the transform applies to the reduced head too
    target = make_tiny_model("gemma2")
    drafter = EagleDrafter.random(target, seed=1)
    hidden = torch.randn(4, target.config.hidden_size)
    full = drafter.logits(hidden)
    ids = torch.tensor([7, 2, 30])
    drafter.restrict_vocab(ids)
    assert torch.equal(drafter.draft_vocab, ids)
    torch.testing.assert_close(drafter.logits(hidden), full[:, ids])
    drafter.share_target(target)  # the same target again: the reduced head follows it
    torch.testing.assert_close(drafter.logits(hidden), full[:, ids])
    drafter.restrict_vocab(None)
    assert drafter.draft_vocab is None and drafter.logits(hidden).shape == full.shape
    vocab = drafter.config.vocab_size
    for bad, why in (
        (torch.tensor([1, 1]), "repeat"),
        (torch.tensor([vocab]), "token ids in"),
        (torch.tensor([], dtype=torch.long), "token ids in"),
        (torch.tensor([0.5]), "token ids"),
    ):
        with pytest.raises(ValueError, match=why):
            drafter.restrict_vocab(bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafted_tokens_come_from_the_reduced_vocabulary_and_q_is_zero_off_it(temperature):
    target = make_tiny_model("llama")
    drafter = EagleDrafter.random(target, seed=1)
    ids = torch.arange(1, drafter.config.vocab_size, 3)
    drafter.restrict_vocab(ids)
    proposer = eagle_proposer(drafter, tree("eagle_default"), cache="dynamic")
    from eagle.decoding import SpeculativeDecoder

    drafts = []
    proposer.propose = _recording(proposer.propose, drafts)
    SpeculativeDecoder(
        target, proposer, SamplingPolicy(temperature=temperature), eos_token_id=[]
    ).generate([1, 5, 9], 12, generator=torch.Generator().manual_seed(0))
    assert drafts
    off = torch.ones(drafter.config.vocab_size, dtype=torch.bool)
    off[ids] = False
    for drafted in drafts:
        assert torch.isin(drafted.tokens, ids).all()
        if temperature:
            assert (
                drafted.q.shape[-1] == drafter.config.vocab_size and (drafted.q[:, off] == 0).all()
            )
            torch.testing.assert_close(drafted.q.sum(-1), torch.ones(len(drafted.tokens)))


def _recording(propose, out: list):
    def wrapped(state):
        drafted = propose(state)
        out.append(drafted)
        return drafted

    return wrapped


def drafter_folder(target_dir, folder):
    """An untrained drafter checkpoint for the target in `target_dir`."""
    target, tokenizer = load_target(target_dir)
    config = DrafterConfig.from_target(target, tokenizer, str(target_dir))
    return save_drafter(EagleDrafter.on_target(config, target), folder)


def test_counting_a_feature_dump_into_a_drafter_folder(tmp_path, target_dir, features_dir, capsys):
    shards = FeatureShards(features_dir, "train")
    items = [shards[i] for i in range(len(shards))]
    vocab = max(int(x["input_ids"].max()) for x in items) + 1
    drafter = drafter_folder(target_dir, tmp_path / "drafter")
    main(["--features", str(features_dir), "--drafter", str(drafter)])
    counts = load_counts(drafter)
    want = torch.zeros(counts.numel(), dtype=torch.long)
    for x in items:
        want += torch.bincount(x["input_ids"][x["loss_mask"] > 0], minlength=counts.numel())
    assert counts.numel() >= vocab and torch.equal(counts, want)
    assert f"{int(want.sum())} predicted tokens counted" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a checkpoint folder"):
        main(["--features", str(features_dir), "--drafter", str(tmp_path / "missing")])


def test_a_dump_of_another_target_leaves_the_drafters_counts_alone(
    tmp_path, target_dir, features_dir
):
    # the counts index the target's vocabulary: another tokenizer's ids would be meaningless ones
    other = save_tiny_target(tmp_path / "other", small_tokenizer(), vocab_size=320)
    drafter = drafter_folder(other, tmp_path / "drafter")
    saved = save_counts(drafter, torch.arange(320))
    before = saved.read_bytes()
    with pytest.raises(SystemExit, match="made for another target.*counts are left as they were"):
        main(["--features", str(features_dir), "--drafter", str(drafter)])
    assert saved.read_bytes() == before
    (tmp_path / "plain").mkdir()
    with pytest.raises(SystemExit, match="names no target|config.json"):
        main(["--features", str(features_dir), "--drafter", str(tmp_path / "plain")])


def test_a_tree_wider_than_the_draft_vocabulary_is_refused():
    target = make_tiny_model("llama")
    drafter = EagleDrafter.random(target, seed=1)
    drafter.restrict_vocab(torch.tensor([3, 4]))  # EAGLE-1's tree takes the top 4 under the root
    decoder = SpeculativeDecoder(
        target,
        eagle_proposer(drafter, tree("eagle_default"), cache="dynamic"),
        SamplingPolicy(),
        eos_token_id=[],
    )
    with pytest.raises(ValueError, match="top 4 of a node, more than the 2 tokens"):
        decoder.generate([1, 5, 9], 4)

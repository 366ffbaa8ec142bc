"""Medusa-1: distinct heads, typical acceptance greedy at temperature 0 and lossy under
sampling (its rule itself: tests/test_acceptance.py; exact verification with Medusa heads:
tests/test_conformance.py), training through train.py with resume, and clear errors for a
wrong target or a tree deeper than the heads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from eagle.acceptance import TypicalAcceptance
from eagle.decoding import SpeculativeDecoder
from eagle.models.checkpoint import CheckpointError, load_medusa, save_drafter, save_medusa
from eagle.models.drafter import EagleDrafter
from eagle.models.medusa import MedusaConfig, MedusaError, MedusaHead, MedusaHeads
from eagle.proposers import medusa_proposer
from eagle.target import TargetMismatchError, lm_head, lm_head_fingerprint, load_target
from eagle.training.medusa import loss_weights, shifted_labels
from eagle.tree import TreeTemplate
from helpers.configs import compose_train
from helpers.decoding import greedy_cases, tree
from helpers.models import FAMILIES, make_tiny_model
from helpers.stats import POLICIES, chi2_pvalue, exact_joint, sample_counts
from train import train

SMALL_TREE = TreeTemplate.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]], name="small")


def feature_batch(h: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 5, h, generator=torch.Generator().manual_seed(seed))  # (B, T, H)


# ---------------------------------------------------------------------------------------
# The heads


def test_heads_are_distinct_modules():
    target = make_tiny_model("llama")
    heads = MedusaHeads.random(target, num_heads=3)
    storages = [p.untyped_storage().data_ptr() for p in heads.parameters()]
    assert len(storages) == len(set(storages)) == 3 * 3  # W1, b1, W2 per head, none shared
    f = feature_batch()
    with torch.no_grad():
        before = heads(f)  # (K, B, T, V)
        heads.heads[0].blocks[0].linear.weight.add_(1.0)
        heads.heads[0].proj.weight.mul_(2.0)
        after = heads(f)
    assert not torch.allclose(before[0], after[0])
    assert torch.equal(before[1:], after[1:])  # the other heads did not move


def test_shared_head_lists_are_refused():
    config = MedusaConfig(num_heads=3, hidden_size=32, vocab_size=96)
    head = MedusaHead(32, 96)
    with pytest.raises(
        MedusaError, match=r"heads 0 and 1 share parameters \(a list built as \[head\] \* K\?\)"
    ):
        MedusaHeads(config, heads=[head] * 3)
    tied = [MedusaHead(32, 96) for _ in range(3)]
    tied[2].proj.weight = tied[1].proj.weight  # one shared tensor is enough to train them as one
    with pytest.raises(MedusaError, match="heads 1 and 2 share parameters"):
        MedusaHeads(config, heads=tied)
    with pytest.raises(MedusaError, match="says 3 heads, got 2"):
        MedusaHeads(config, heads=tied[:2])


def test_head_forward_is_medusas_residual_block():
    """head_k(f) = W2 (f + SiLU(W1 f + b1)); fresh heads start with W1 = 0 and W2 = lm_head."""
    target = make_tiny_model("qwen2", tie_word_embeddings=False)
    fresh = MedusaHeads.for_target(target, num_heads=2)
    for head in fresh.heads:
        assert torch.equal(head.blocks[0].linear.weight, torch.zeros(32, 32))
        assert torch.equal(head.proj.weight, lm_head(target).weight)
    heads = MedusaHeads.random(target, num_heads=2)
    f = feature_batch()
    with torch.no_grad():
        got = heads(f)
        for k, head in enumerate(heads.heads):
            lin = head.blocks[0].linear
            h = f + F.silu(f @ lin.weight.T + lin.bias)
            torch.testing.assert_close(got[k], h @ head.proj.weight.T)
    assert not torch.allclose(got[0], got[1])  # random W1: the heads differ from each other
    assert not torch.allclose(got[0], lm_head(target)(f))  # ... and from the LM head


@pytest.mark.parametrize("family", ["cohere", "gemma2", "llama"])
def test_a_fresh_heads_logits_take_the_targets_transform(family, tmp_path):
    """A fresh head whose block is the identity (W1 = 0, b1 = 0) is the target's own next-token
    head: its logits are `head_logits`', Cohere's scale and Gemma-2's soft-cap included (they were
    the LM head's raw products: 1.76 and 1.05 apart), over a drafting vocabulary too, and after a
    save and a load."""
    from eagle.target import head_logits

    target = make_tiny_model(family, tie_word_embeddings=False)
    heads = MedusaHeads.for_target(target, num_heads=2)
    for head in heads.heads:
        torch.nn.init.zeros_(head.blocks[0].linear.bias)
    f = feature_batch()
    with torch.no_grad():
        want = head_logits(target, f)
        torch.testing.assert_close(heads(f)[1], want)
        heads.restrict_vocab(torch.tensor([3, 5, 7]))
        torch.testing.assert_close(heads.drafted(f)[0], want[..., [3, 5, 7]])
        save_medusa(heads, tmp_path / "m")
        torch.testing.assert_close(
            load_medusa(tmp_path / "m", target).drafted(f)[1], want[..., [3, 5, 7]]
        )


# ---------------------------------------------------------------------------------------
# Decoding: exact mode is exact, typical mode is lossy


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_typical_acceptance_at_temperature_0_is_greedy(family):
    target = make_tiny_model(family)
    heads = MedusaHeads.random(target, num_heads=4)
    cases = greedy_cases(target, 8)
    accepted = 0
    for name, template in (
        ("medusa_default", tree("medusa_default")),
        ("chain4", TreeTemplate.chain(4)),
    ):
        proposer = medusa_proposer(heads, template)
        for prompt, max_new, eos, ref in cases:
            decoder = SpeculativeDecoder(
                target,
                proposer,
                eos_token_id=[] if eos is None else eos,
                typical=TypicalAcceptance(),
            )
            res = decoder.generate(prompt, max_new)
            assert res.tokens == ref, (
                f"{family}/{name}/typical: prompt {len(prompt)}, max_new {max_new}"
            )
            accepted += sum(r.accepted for r in res.stats.rounds)
    assert accepted > 0  # the random heads do get paths accepted


def test_typical_mode_is_lossy_under_sampling():
    """The same setup under typical acceptance does not follow p: it is labelled lossy for this."""
    policy = POLICIES["t1"]
    target = make_tiny_model("llama", vocab_size=5, seed=3)
    heads = MedusaHeads.random(target, num_heads=2, seed=4)
    decoder = SpeculativeDecoder(
        target,
        medusa_proposer(heads, SMALL_TREE),
        policy,
        eos_token_id=[],
        typical=TypicalAcceptance(),
    )
    prompt, n, runs = [1, 3, 2], 3, 200
    counts, _ = sample_counts(lambda g: decoder.generate(prompt, n, generator=g), runs)
    assert chi2_pvalue(counts, exact_joint(target, prompt, policy, n), runs) < 1e-6


def test_tree_deeper_than_heads_is_refused():
    heads = MedusaHeads.random(make_tiny_model("llama"), num_heads=2)
    with pytest.raises(
        MedusaError, match="tree 'medusa_default' is 3 deep but there are only 2 Medusa heads"
    ):
        medusa_proposer(heads, tree("medusa_default"))


# ---------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_round_trip_and_wrong_target(tmp_path):
    target = make_tiny_model("llama")
    heads = MedusaHeads.random(target, num_heads=3, path="runs/tiny")
    where = tmp_path / "m"
    save_medusa(heads, where)
    config = json.loads((where / "config.json").read_text())
    assert config["architecture"] == "MedusaHeads" and config["num_heads"] == 3
    loaded = load_medusa(where, target)
    assert loaded.config == heads.config
    f = feature_batch()
    with torch.no_grad():
        assert torch.equal(loaded(f), heads(f))
    with pytest.raises(
        TargetMismatchError,
        match=f"Medusa heads {where} was made for another target: hidden_size 32 != 64",
    ):
        load_medusa(where, make_tiny_model("llama", hidden_size=64))
    with pytest.raises(TargetMismatchError, match="vocab_size 96 != 80"):
        load_medusa(where, make_tiny_model("llama", vocab_size=80))
    save_drafter(EagleDrafter.random(target), tmp_path / "d")
    with pytest.raises(
        CheckpointError, match="architecture is 'EagleDrafter', expected 'MedusaHeads'"
    ):
        load_medusa(tmp_path / "d", target)
    with pytest.raises(CheckpointError, match="Medusa checkpoint .* does not exist"):
        load_medusa(tmp_path / "nowhere", target)


# ---------------------------------------------------------------------------------------
# Training


def test_shifted_labels_alignment():
    """Head k at position t predicts x_{t+k+1}, weighted by m_{t+k+1}; nothing past the end."""
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    labels, w = shifted_labels(ids, mask, shift=2)  # head 1
    assert labels.tolist() == [[12, 13, 14, 0, 0]] and w.tolist() == [[1, 1, 0, 0, 0]]
    labels, w = shifted_labels(ids, mask, shift=1)  # the LM head itself
    assert labels.tolist() == [[11, 12, 13, 14, 0]] and w.tolist() == [[0, 1, 1, 0, 0]]
    labels, w = shifted_labels(ids, mask, shift=7)  # longer than the sample
    assert labels.tolist() == [[0] * 5] and w.sum() == 0
    assert loss_weights(3, 0.8) == pytest.approx([1.0, 0.8, 0.64])
    assert loss_weights(2, 0.8, [1, 0]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="one per head"):
        loss_weights(3, 0.8, [1.0])


def test_medusa_configs_compose():
    for name in ("medusa_smollm2", "medusa_test"):
        cfg = compose_train([f"experiment={name}", "paths.root_dir=/nowhere"])
        OmegaConf.resolve(cfg)
        assert cfg.task_name == name
        m = cfg.model
        assert m._target_ == "eagle.training.medusa.MedusaModule"
        # Medusa-1's recipe
        assert (m.optim.lr, m.optim.weight_decay, m.optim.schedule, m.num_layers) == (
            1e-3,
            0.0,
            "cosine",
            1,
        )
        assert cfg.data.datamodule._target_ == "eagle.training.datamodules.FeatureDataModule"
    smol = compose_train(["experiment=medusa_smollm2", "paths.root_dir=/nowhere"])
    assert smol.model.target_path == "/nowhere/runs/smollm2/model"
    assert smol.model.num_heads >= tree("medusa_default").depth


def medusa_cfg(tmp_path: Path, target_dir: Path, features_dir: Path, *overrides: str):
    return compose_train(
        [
            "experiment=medusa_test",
            f"paths.runs_dir={tmp_path}",
            f"model.target_path={target_dir}",
            f"data.datamodule.features_dir={features_dir}",
            *overrides,
        ]
    )


def test_train_resume_and_export(tmp_path, target_dir, features_dir):
    first = train(medusa_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2"))
    run_dir = tmp_path / "medusa_test"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert first["steps"] == 2 and last.exists()
    state = torch.load(last, map_location="cpu", weights_only=False)["state_dict"]
    assert all(k.startswith("heads.heads.") for k in state)  # the heads only, never the target
    assert {k.split(".")[2] for k in state} == {"0", "1", "2"}

    second = train(medusa_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=4"))
    assert second["resumed_from_step"] == 2 and second["steps"] == 4
    for key in (
        "val/loss",
        "val/loss_h1",
        "val/loss_h3",
        "val/top1_h1",
        "val/top5_h1",
        "val/top1_h3",
        "val/top1_h0",
    ):
        assert math.isfinite(second[key]), key
    assert 0.0 <= second["val/top1_h1"] <= second["val/top5_h1"] <= 1.0
    assert second["medusa_dir"] == str(run_dir / "medusa")
    assert json.loads((run_dir / "medusa" / "train_metrics.json").read_text())["steps"] == 4
    model, tokenizer = load_target(target_dir)
    heads = load_medusa(run_dir / "medusa", model, tokenizer)  # checked against the target
    assert heads.num_heads == 3
    assert heads.config.target["lm_head_sha256"] == lm_head_fingerprint(
        model
    )  # the head it was trained against

    other = tmp_path / "other"
    make_tiny_model("llama", seed=7, hidden_size=64, vocab_size=len(tokenizer)).save_pretrained(
        other
    )
    tokenizer.save_pretrained(other)
    with pytest.raises(TargetMismatchError, match="hidden_size 32 != 64"):
        load_medusa(run_dir / "medusa", *load_target(other))


def test_heads_trained_over_a_reduced_vocabulary(tmp_path, target_dir, features_dir, capsys):
    """loss_vocab=K: each head's training loss is the cross-entropy over the K most frequent
    tokens of the training split (its projection's rows at those ids), labels outside them are
    left out; validation scores the whole vocabulary, and the rows outside K keep the LM head."""
    import types

    from eagle.data.batches import collate
    from eagle.data.features import FeatureShards
    from eagle.data.vocab import draft_vocabulary
    from eagle.training.datamodules import FeatureDataModule
    from eagle.training.medusa import MedusaModule

    k = 16
    trained = train(
        medusa_cfg(
            tmp_path, target_dir, features_dir, "trainer.max_steps=3", f"model.loss_vocab={k}"
        )
    )
    assert f"Medusa loss over the {k} most frequent" in capsys.readouterr().out
    assert math.isfinite(trained["val/loss_h1"])
    model, tokenizer = load_target(target_dir)
    heads = load_medusa(tmp_path / "medusa_test" / "medusa", model, tokenizer)
    module = MedusaModule(str(target_dir), num_heads=3, loss_vocab=k)
    datamodule = FeatureDataModule(features_dir, batch_size=4)
    datamodule.setup("fit")
    module._trainer = types.SimpleNamespace(
        datamodule=datamodule
    )  # setup() reads the data's token counts
    module.setup("fit")
    ids, _ = draft_vocabulary(datamodule.token_counts(len(tokenizer)), k)
    assert torch.equal(module.loss_ids, ids)
    assert heads.config.draft_vocab == ids.tolist()  # saved: the heads draft from those tokens only
    outside = torch.ones(len(tokenizer), dtype=torch.bool)
    outside[ids] = False
    for head in heads.heads:  # trained rows moved, the others are still the LM head
        torch.testing.assert_close(
            head.proj.weight[outside], model.lm_head.weight[outside].to(head.proj.weight.dtype)
        )
        assert not torch.allclose(head.proj.weight[ids], model.lm_head.weight[ids])

    batch = collate([FeatureShards(features_dir, "train")[i] for i in range(4)])
    train_out, val_out = module.model_step(batch, train=True), module.model_step(batch)
    assert train_out["logits"][0].shape[-1] == k and val_out["logits"][0].shape[-1] == len(
        tokenizer
    )
    assert torch.isneginf(
        val_out["logits"][0][..., outside]
    ).all()  # validation scores what decoding drafts
    for h in range(3):
        torch.testing.assert_close(train_out["logits"][h], val_out["logits"][h][..., ids])
        labels, w = shifted_labels(batch["input_ids"], batch["loss_mask"], shift=h + 2)
        inside = torch.isin(labels, ids) & (w > 0)
        assert torch.equal(train_out["weights"][h] > 0, inside)
        position = {int(t): i for i, t in enumerate(ids)}
        want = F.cross_entropy(
            val_out["logits"][h][..., ids][inside],
            torch.tensor([position[int(t)] for t in labels[inside]]),
        )
        torch.testing.assert_close(train_out["loss_h"][h], want)
    with pytest.raises(ValueError, match="loss_vocab must be"):
        MedusaModule(str(target_dir), loss_vocab=0)


def test_drafting_rows_are_copied_once_per_version_of_the_weights():
    """Decoding reuses one copy of the drafting vocabulary's rows; an optimizer step (an in-place
    update) makes the next forward copy them again."""
    heads = MedusaHeads.random(make_tiny_model("llama"), num_heads=2)
    heads.restrict_vocab(torch.arange(0, heads.config.vocab_size, 3))
    f = torch.randn(4, heads.config.hidden_size)
    with torch.no_grad():
        first = heads(f)
        assert heads._rows()[0] is heads._rows()[0]  # reused
        heads.heads[0].proj.weight.mul_(2.0)
        second = heads(f)
    ids = heads.vocab_ids()
    torch.testing.assert_close(second[0][..., ids], 2 * first[0][..., ids], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[1], first[1])

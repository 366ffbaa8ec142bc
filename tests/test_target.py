"""Target access: features feed the LM head exactly, per family; bad paths fail in one line."""

from __future__ import annotations

import pytest
import torch

from eagle.target import (
    TargetError,
    check_model_dir,
    embeddings,
    lm_head,
    load_target,
    load_tokenizer,
    target_forward,
)
from helpers.models import FAMILIES, make_tiny_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lm_head_of_feature_equals_logits(family):
    model = make_tiny_model(family)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    out = target_forward(model, ids)
    reference = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(lm_head(model)(out.features), reference.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=1e-6)
    # the feature is the post-norm hidden state, i.e. Hugging Face's last hidden_states entry
    torch.testing.assert_close(out.features, reference.hidden_states[-1], rtol=0, atol=1e-6)
    assert embeddings(model).weight.shape == (model.config.vocab_size, model.config.hidden_size)


def test_logits_slice_keeps_all_features():
    model = make_tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    out = target_forward(model, ids, logits_slice=slice(-1, None))
    assert out.logits.shape == (1, 1, model.config.vocab_size)
    assert out.features.shape == (1, 9, model.config.hidden_size)


def test_save_load_round_trip(tmp_path):
    model = make_tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(TargetError, match="has no tokenizer"):
        load_target(tmp_path / "m")
    loaded, tok = load_target(tmp_path / "m", with_tokenizer=False)
    assert tok is None
    ids = torch.randint(0, model.config.vocab_size, (1, 11))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_missing_paths_fail_clearly(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="no config.json"):
        load_target(tmp_path / "empty")
    with pytest.raises(TargetError, match="does not exist"):
        load_tokenizer("./not/a/model")

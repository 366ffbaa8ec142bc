"""The masks given to Hugging Face models carry each layer type's locality: on a plain sequence,
a model given `for_layers`' mask scores what it scores with its own masks."""

from __future__ import annotations

import pytest
import torch

from eagle.decoding.masks import attention_chunk, causal_mask, for_layers, is_local, sliding_window
from helpers.models import make_tiny_model


@pytest.mark.parametrize("family, window, chunk", [
    ("mistral", 16, None),       # one window, one mask for every layer
    ("gemma3_text", 16, None),   # sliding and full layers: a mask per layer type
    ("llama4_text", None, 16),   # chunked and full layers
    ("llama", None, None),       # nothing local: the mask itself
])
def test_a_models_own_masks_are_what_for_layers_gives_it(family, window, chunk):
    model = make_tiny_model(family)
    assert (sliding_window(model.config), attention_chunk(model.config)) == (window, chunk)
    assert is_local(model.config) == (window is not None or chunk is not None)
    n = 40  # crosses the window and two chunk boundaries
    ids = torch.randint(
        3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.arange(n)
    mask = for_layers(model.config, causal_mask(0, n, torch.float32), positions, positions)
    with torch.inference_mode():
        own = model(ids).logits
        given = model(ids, attention_mask=mask, position_ids=positions[None]).logits
        plain = model(
            ids, attention_mask=causal_mask(0, n, torch.float32), position_ids=positions[None]
        ).logits
    torch.testing.assert_close(given, own, rtol=0, atol=1e-5)
    if is_local(model.config):  # and the locality matters on this sequence
        assert (plain - own).abs().max() > 1e-3

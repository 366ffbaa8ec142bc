"""The tests' small byte-level BPE (tests/helpers/tokenizer.py): exact round trips, the special
ids of the tiny random models, and a chat template that marks the assistant tokens."""

from __future__ import annotations

import pytest

from eagle.target import tokenizer_hash
from helpers.models import TEXTS, small_tokenizer
from helpers.tokenizer import BOS, EOS, PAD, ROLE_TOKENS, train_bpe_tokenizer

STRINGS = [
    "",
    " ",
    "def f(x):\n\treturn x  \n\n\n",
    "    indented\r\n        more\r\n",
    "naïve café — 東京 😀 \u00a0nbsp \ufffd",
    "trailing spaces   ",
    "<|bos|> is text here, not a special token? ",
]


@pytest.fixture(scope="module")
def tok():
    return small_tokenizer()


def test_round_trip(tok):
    for text in [*TEXTS[:3], *STRINGS[:-1]]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids[1:]) == text
    # Special-token strings in text map to the special ids; decoding still gives the text.
    text = STRINGS[-1]
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for token in [PAD, BOS, EOS, *ROLE_TOKENS.values()]:
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] == tok.convert_tokens_to_ids(token)
    assert len(tok) == 300
    assert tok("x")["input_ids"][0] == tok.bos_token_id
    assert tok.decode(tok("x")["input_ids"]) == "<|bos|>x"
    assert tokenizer_hash(small_tokenizer()) == tokenizer_hash(tok)  # trained deterministically
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(TEXTS, vocab_size=100)


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sum 1 and 2."},
        {"role": "assistant", "content": "print(1 + 2)"},
        {"role": "user", "content": "And 3?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|system|>\nBe brief.\n<|user|>\nSum 1 and 2.\n"
        "<|assistant|>\nprint(1 + 2)<|eos|><|user|>\nAnd 3?\n<|assistant|>\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text[: -len("<|assistant|>\n")]
    out = tok.apply_chat_template(
        messages[:3], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids.count(tok.bos_token_id) == 1  # the template's bos only, none added on top
    assistant = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(assistant) == "print(1 + 2)<|eos|>"  # the loss mask: reply and eos
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)

"""The built-in byte-level BPE: exact round trips, special tokens, chat template, reuse."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from data_gen.corpus import build_python_corpus, stdlib_dir
from data_gen.tokenizer import BOS, EOS, PAD, ROLE_TOKENS, build_tokenizer
from eagle.target import tokenizer_hash

# Real stdlib files that stress the round trip: non-ASCII text, a file that is not UTF-8
# (decoded with replacement characters), and \r\n line endings.
HARD_FILES = [
    "test/test_unicode.py",
    "re/_casefix.py",
    "shlex.py",
    "pydoc_data/topics.py",
    "test/encoded_modules/module_koi8_r.py",
    "lib2to3/tests/data/crlf.py",
    "json/__init__.py",
]
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
def corpus():
    return build_python_corpus(val_fraction=0.25, max_files=48)


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_tokenizer(list(corpus["train"]["text"]), vocab_size=512, save_dir=path)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def read(rel: str) -> str:
    return (stdlib_dir() / rel).read_bytes().decode("utf-8", errors="replace")


def test_round_trip_real_files(tok, corpus):
    present = [rel for rel in HARD_FILES if (stdlib_dir() / rel).exists()]
    assert len(present) >= 4
    texts = [read(rel) for rel in present] + list(corpus["validation"]["text"])
    assert any(any(ord(c) > 127 for c in t) for t in texts)
    assert any("\ufffd" in t for t in texts) and any("\r\n" in t for t in texts)
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids[1:]) == text


def test_round_trip_strings(tok):
    for text in STRINGS[:-1]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # Special-token strings in text map to the special ids; decoding still gives the text.
    text = STRINGS[-1]
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for token in [PAD, BOS, EOS, *ROLE_TOKENS.values()]:
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] == tok.convert_tokens_to_ids(token)
    assert len(tok) == 512
    assert tok("x")["input_ids"][0] == tok.bos_token_id
    assert tok.decode(tok("x")["input_ids"]) == "<|bos|>x"


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


def test_reuse_and_mismatch(tokenizer_dir, tok, corpus):
    texts = list(corpus["train"]["text"])
    again = build_tokenizer(texts, vocab_size=512, save_dir=tokenizer_dir)  # reloads
    assert tokenizer_hash(again) == tokenizer_hash(tok)
    fresh = build_tokenizer(texts, vocab_size=512)  # retrain: deterministic
    assert tokenizer_hash(fresh) == tokenizer_hash(tok)
    with pytest.raises(ValueError, match=r"was built with other settings \(vocab_size: 512 -> 1024\)"):
        build_tokenizer(texts, vocab_size=1024, save_dir=tokenizer_dir)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(texts, vocab_size=100)

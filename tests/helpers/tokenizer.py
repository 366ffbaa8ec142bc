"""A byte-level BPE with a chat template, trained offline on a few texts: the tests' tokenizer.

Byte-level, so every string round-trips exactly (`decode(encode(s)) == s`). `encode` prepends
`<|bos|>`. The special ids are those of the tiny random models (pad 0, bos 1, eos 2), and
the chat template marks the assistant tokens with `{% generation %}` as real templates do.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Order fixes the ids: pad=0, bos=1, eos=2 (as in the tiny random models).
SPECIAL_TOKENS = [PAD, BOS, EOS, *(ROLE_TOKENS[r] for r in ("user", "assistant", "system"))]

# Every turn is `<|role|>\n content`; user/system turns end with a newline, assistant turns
# with eos (the stop token). `{% generation %}` marks the assistant tokens, so
# `apply_chat_template(..., return_assistant_tokens_mask=True)` gives the loss mask.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>\n' -}}"
    "{% generation %}{{- message['content'] + eos_token -}}{% endgeneration %}"
    "{%- elif message['role'] == 'user' or message['role'] == 'system' -%}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('unknown chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 300, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it as a Hugging Face fast tokenizer.

    Args:
        texts: training documents.
        vocab_size: final vocabulary size, special tokens and the 256 byte symbols included.
        min_frequency: a pair must occur this often to be merged.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # No normalizer: any normalisation (NFC, stripping) would break the exact round trip.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS.values()),
        clean_up_tokenization_spaces=False,  # decoding must not touch spaces
        chat_template=CHAT_TEMPLATE,
    )

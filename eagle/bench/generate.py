"""Generate with any method and print each accepted block as it is committed.

One prompt streams its text; several are decoded at once, in one batch, each block tagged with
its prompt's number. The last line gives the method, its dtype (and LOSSY where its acceptance
is), the tokens, the rate and tau. `decode.py` (its default mode) calls `generate`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from eagle.bench.benchmark import encode_prompt
from eagle.bench.evalsets import Prompt
from eagle.bench.methods import Method
from eagle.sampling import SamplingPolicy, seeded_generator

if TYPE_CHECKING:
    from eagle.bench.builder import Methods


def generate(methods: Methods, name: str, prompt: str | Sequence[str], policy: SamplingPolicy,
             max_new_tokens: int, chat: bool = False, seed: int = 0, dtype: str = "auto") -> None:
    """Decode `prompt` with method `name` (built by `methods`, in `dtype`; auto: the machine's
    choice) and print it as it comes. A list of prompts is decoded at once, in one batch."""
    dtype = methods.dtype(name, {} if dtype == "auto" else {name: dtype})
    method = methods.build(name, dtype)
    _, tokenizer = methods.target(dtype)
    generator = seeded_generator(seed, methods.device)
    torch.manual_seed(seed)
    if not isinstance(prompt, str):
        batch = [encode_prompt(tokenizer, Prompt(id=f"cli{i}", text=str(p), chat=chat))
                 for i, p in enumerate(prompt)]
        return stream_batch(method, dtype, tokenizer, batch, max_new_tokens, policy, generator)
    ids = encode_prompt(tokenizer, Prompt(id="cli", text=prompt, chat=chat))
    shown: list[int] = []
    printed = ""

    def stream(block: list[int]) -> None:  # all of it decoded again: multi-byte tokens print whole
        nonlocal printed
        shown.extend(block)
        text = tokenizer.decode(shown, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    print(tokenizer.decode(ids, skip_special_tokens=True), end="", flush=True)
    out = method.generate(ids, max_new_tokens, policy, generator, on_commit=stream)
    print(f"\n\n[{method.name}, {dtype}{_lossy(method)}] {len(out.tokens)} tokens in "
          f"{out.seconds:.2f}s: {len(out.tokens) / out.seconds:.1f} tokens/s, tau {out.tau:.2f}")


def stream_batch(method: Method, dtype: str, tokenizer, batch: list[list[int]], max_new_tokens: int,
                 policy: SamplingPolicy, generator) -> None:
    """Every prompt of `batch` decoded at once; each committed block is printed as it comes,
    tagged with its prompt's number, then every full text."""
    shown: list[list[int]] = [[] for _ in batch]

    def stream(row: int, block: list[int]) -> None:
        before = tokenizer.decode(shown[row], skip_special_tokens=True)
        shown[row].extend(block)
        text = tokenizer.decode(shown[row], skip_special_tokens=True)
        print(f"[{row}] {text[len(before):]!r}", flush=True)

    start = time.perf_counter()
    outs = method.generate_batch(batch, max_new_tokens, policy, generator, on_commit=stream)
    seconds = time.perf_counter() - start
    for row, (ids, out) in enumerate(zip(batch, outs)):
        print(f"\n[{row}] {tokenizer.decode(ids + out.tokens, skip_special_tokens=True)}\n"
              f"[{row}] {len(out.tokens)} tokens, tau {out.tau:.2f}")
    tokens = sum(len(o.tokens) for o in outs)
    print(f"\n[{method.name}, {dtype}{_lossy(method)}] {len(batch)} sequences at once: {tokens} "
          f"tokens in {seconds:.2f}s, {tokens / seconds:.1f} tokens/s")


def _lossy(method: Method) -> str:
    return "" if method.lossless else f", LOSSY ({method.lossy})"

"""Decoding methods by name: one registry, one parser, one typed settings class per method.

A method is named `NAME[@TREE][%K][:RUNNER]`:
  - NAME: a key of `METHODS` (vanilla, eagle, eagle_lookup, draft, specinfer_merge, prompt_lookup,
    medusa, medusa_typical, and the Hugging Face peers hf_generate, hf_assisted, hf_prompt_lookup);
  - @TREE: another tree for a method that drafts one (`eagle@chain5`, a name in configs/tree/
    or a YAML path), so several trees run side by side in one benchmark;
  - %K: EAGLE drafting from its K most frequent tokens (`eagle%1024`; `eagle.draft_vocab`);
  - :RUNNER: how the target (and the draft model's cache) keeps its KV for an engine method:
    `dynamic` (a growing cache) or `static` (preallocated, fixed shapes, compilable); without
    it, the context's default runner.

`METHODS` says, per method, how to build it and what it is: whether it takes a tree, needs a
draft LM, is lossy (only medusa_typical: Medusa's typical acceptance), verifies wide trees
(bf16 pays off for those where the hardware has it), and whether it runs in our engine.
Every method reports the same statistics (`eagle.decoding.stats`), the Hugging Face peers
included: their rounds are rebuilt from forward hooks on the target.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from eagle.acceptance import TypicalAcceptance
from eagle.decoding.backend import backend_of
from eagle.decoding.engine import Proposer, SpeculativeDecoder, check_fits
from eagle.decoding.runners import RUNNERS, make_runner
from eagle.decoding.stats import DecodeResult, DecodeStats, RoundStats
from eagle.hardware import auto_dtype, resolve_dtype_name
from eagle.sampling import SamplingPolicy
from eagle.target import context_length
from eagle.tree import resolve_tree


class MethodError(ValueError):
    """A method that cannot be built as configured."""


# ---------------------------------------------------------------------------------------
# settings: one typed class per method family; the decode config has one section of each


@dataclass(frozen=True)
class EagleSettings:
    drafter: str | None = None     # drafter checkpoint directory
    random: bool = False  # explicit: an untrained drafter (to check losslessness on a new target)
    tree: str = "eagle_default"  # tree name (configs/tree/) or YAML path
    proposal: str = "sample"  # under sampling: "sample" (drawn without replacement) or "topk"
    # draft from the K most frequent tokens of the drafter's training data (FR-Spec,
    # eagle/data/vocab.py); None: the whole vocabulary
    draft_vocab: int | None = None


@dataclass(frozen=True)
class EagleLookupSettings(EagleSettings):
    num_tokens: int = 10  # prompt lookup's chain, merged with EAGLE's tree each round
    max_ngram: int = 3
    min_ngram: int = 3  # a shorter match drafts most rounds and is rarely right (LOG.md)


@dataclass(frozen=True)
class DraftSettings:
    model: str | None = None  # small LM sharing the target's tokenizer
    tree: str = "chain5"  # classic speculative decoding drafts a chain
    proposal: str = "sample"


@dataclass(frozen=True)
class MergeSettings:
    models: tuple[
        str, ...
    ] = ()  # the SSMs' folders (small LMs sharing the target's tokenizer), in order
    tree: str = "chain5"  # the tree each SSM drafts (a chain, or an expansion: specinfer_*)
    budget: int | None = None  # most nodes of the merged tree; None = every SSM's whole tree
    proposal: str = "sample"


@dataclass(frozen=True)
class PromptLookupSettings:
    num_tokens: int = 10  # draft length
    max_ngram: int = 2  # longest n-gram matched (Hugging Face's max_matching_ngram_size)


@dataclass(frozen=True)
class MedusaSettings:
    heads: str | None = None  # Medusa heads checkpoint directory
    random: bool = False  # explicit: untrained heads, one per depth of the tree
    tree: str = "medusa_default"
    proposal: str = "sample"
    typical_eps: float = 0.09  # medusa_typical only: Medusa's posterior_threshold
    typical_delta: float = 0.3  # medusa_typical only: Medusa's posterior_alpha


@dataclass
class MethodContext:
    """What every method is built against: the target (in the method's dtype) and the run's options.

    Attributes:
        draft_lm: loads a draft LM from a path, on the target's device and in its dtype.
        runner: the default runner of engine methods ("dynamic" or "static").
        static_max_len: slots of static caches (None: per sequence, rounded up).
        compile_mode: compile static passes (`eagle.decoding.compile.compile_static`).
    """

    target: nn.Module
    tokenizer: Any = None
    target_path: str | None = None
    tree_dirs: tuple[str, ...] = ()
    draft_lm: Callable[[str], nn.Module] | None = None
    runner: str = "dynamic"
    static_max_len: int | None = None
    compile_mode: str | None = None

    @property
    def eos(self):
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None


# ---------------------------------------------------------------------------------------
# methods


class Method:
    """A named way to decode with a target; `generate` returns tokens and statistics."""

    def __init__(
        self,
        name: str,
        info: MethodInfo,
        target: nn.Module,
        eos_token_id,
        tree_parents: tuple[int, ...] | None = None,
    ):
        self.name, self.info, self.target, self.eos_token_id = name, info, target, eos_token_id
        self.tree_parents = tree_parents  # the fixed draft tree's parent list, if any

    @property
    def lossy(self) -> str | None:
        """Why the output distribution differs from the target's; None: lossless."""
        return self.info.lossy

    @property
    def batches(self) -> bool:
        """Decodes several sequences at once (`generate_batch`)."""
        return False

    @property
    def static(self) -> bool:
        """Runs the target on a static runner: fixed buffers, and graphs (compiled or CUDA)
        built for the cache size they first meet."""
        return False

    @property
    def lossless(self) -> bool:
        """Distribution-preserving by construction (proved by the test suite)."""
        return self.info.lossy is None

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        policy: SamplingPolicy,
        generator: torch.Generator | None = None,
        on_commit=None,
    ) -> DecodeResult:
        raise NotImplementedError

    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        policy: SamplingPolicy,
        generator: torch.Generator | None = None,
        on_commit=None,
    ) -> list[DecodeResult]:
        """Several sequences at once; `on_commit(row, block)` streams each. One result per prompt.
        """
        raise MethodError(f"method {self.name!r} decodes one sequence at a time")


class EngineMethod(Method):
    """A proposer run by the speculative loop (vanilla when `proposer` is None) with a target
    runner kept across generations (a static runner's buffers and compiled graphs are reused)."""

    def __init__(
        self,
        name: str,
        info: MethodInfo,
        ctx: MethodContext,
        runner: str,
        proposer: Proposer | None = None,
        tree_parents: tuple[int, ...] | None = None,
        typical: TypicalAcceptance | None = None,
    ):
        super().__init__(name, info, ctx.target, ctx.eos, tree_parents)
        self.proposer, self.typical = proposer, typical
        compile_mode = ctx.compile_mode if runner == "static" else None
        self.runner_kind = runner
        self.runner = make_runner(
            runner,
            ctx.target,
            tree_size=proposer.max_nodes if proposer else 0,
            max_len=ctx.static_max_len,
            compile_mode=compile_mode,
        )

    @property
    def batches(self) -> bool:
        return True

    @property
    def static(self) -> bool:
        return self.runner_kind == "static"

    def decoder(self, policy: SamplingPolicy) -> SpeculativeDecoder:
        return SpeculativeDecoder(
            self.target,
            self.proposer,
            policy,
            eos_token_id=self.eos_token_id,
            typical=self.typical,
            runner=self.runner,
        )

    def generate(
        self, prompt, max_new_tokens, policy, generator=None, on_commit=None
    ) -> DecodeResult:
        return self.decoder(policy).generate(
            prompt, max_new_tokens, generator=generator, on_commit=on_commit
        )

    def generate_batch(
        self, prompts, max_new_tokens, policy, generator=None, on_commit=None
    ) -> list[DecodeResult]:
        return self.decoder(policy).generate_batch(
            prompts, max_new_tokens, generator=generator, on_commit=on_commit
        )


class HFMethod(Method):
    """`model.generate`, with assisted generation or prompt lookup as asked. Forward hooks on
    the target time each forward and read the position its input starts at, which gives the
    same per-round statistics as the engine: the first forward is the prefill (committing one
    token, as in the engine), each later forward is a round whose tokens beyond the first are
    drafts, and the start of the next forward says how many tokens it committed. (Assisted
    generation verifies candidates in its first forward already; those tokens are counted in
    the last round, which keeps tau = (new tokens - 1) / forwards after the first.)"""

    def __init__(
        self, name: str, info: MethodInfo, target: nn.Module, eos_token_id, **generate_kwargs
    ):
        super().__init__(name, info, target, eos_token_id)
        self.generate_kwargs = generate_kwargs
        self._calls: list[
            list[float]
        ] = []  # per forward: [start position, tokens in, t begin, t end]
        self._cuda = False  # the target is on a GPU (set per generate)

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("position_ids")
        start = int(pos[0, 0]) if pos is not None and pos.numel() else 0
        self._calls.append([start, ids.shape[-1], time.perf_counter(), 0.0])

    def _after(self, module, args, output):
        if (
            self._cuda
        ):  # the forward's kernels end here, not at their launch: its wait is verification
            torch.cuda.synchronize()
        self._calls[-1][3] = time.perf_counter()

    @property
    def batches(self) -> bool:
        return (
            not self.generate_kwargs
        )  # Hugging Face's assisted generation and prompt lookup refuse batches

    def generate(
        self, prompt, max_new_tokens, policy, generator=None, on_commit=None
    ) -> DecodeResult:
        stream = None if on_commit is None else (lambda row, block: on_commit(block))
        return self.generate_batch([prompt], max_new_tokens, policy, generator, stream)[0]

    def generate_batch(
        self, prompts, max_new_tokens, policy, generator=None, on_commit=None
    ) -> list[DecodeResult]:
        """`model.generate` on the prompts, left-padded (Hugging Face's batching); assisted
        generation and prompt lookup refuse batches, and so do they here."""
        if len(prompts) > 1 and not self.batches:
            raise MethodError(
                f"method {self.name!r}: Hugging Face's assisted generation and prompt lookup "
                "decode "
                "one sequence at a time"
            )
        for prompt in prompts:
            check_fits(
                len(prompt), max_new_tokens, 0, context_length(self.target)
            )  # HF would decode past it, garbled
        device = next(self.target.parameters()).device
        width = max(map(len, prompts))
        eos = self.eos_token_id if self.eos_token_id is not None else []
        pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
        ids = torch.tensor(
            [[pad] * (width - len(p)) + list(p) for p in prompts], device=device
        )  # (B, T) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = (
            {"do_sample": False}
            if policy.greedy
            else {
                "do_sample": True,
                "temperature": policy.temperature,
                "top_k": policy.top_k,
                "top_p": policy.top_p,
            }
        )
        if (
            generator is not None and not policy.greedy
        ):  # HF samples from the global RNG: seed it from ours
            torch.manual_seed(
                int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))
            )
        self._calls, self._cuda = [], device.type == "cuda"
        hooks = [
            self.target.register_forward_pre_hook(self._before, with_kwargs=True),
            self.target.register_forward_hook(self._after),
        ]
        start = time.perf_counter()
        try:
            # the weights stay fixed for the call, as the engine decodes (the target's backend)
            with torch.inference_mode(), backend_of(self.target).weights_fixed(self.target):
                out = self.target.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=pad,
                    **sampling,
                    **self.generate_kwargs,
                )
        finally:
            for h in hooks:
                h.remove()
        end = time.perf_counter()
        stop = {eos} if isinstance(eos, int) else set(eos)
        results = []
        for row, tokens in enumerate(out[:, width:].tolist()):
            ends = [
                i for i, t in enumerate(tokens) if t in stop
            ]  # a finished row is padded after its EOS
            tokens = tokens[: ends[0] + 1] if ends else tokens
            # a row's forwards: the prefill, then one per token after the first (only assisted
            # generation, one sequence, commits more per forward)
            calls = self._calls if len(prompts) == 1 else self._calls[: len(tokens)]
            stats = self._stats(
                calls,
                len(prompts[row]),
                len(tokens),
                start,
                end if len(prompts) == 1 else calls[-1][3],
            )
            if on_commit:
                on_commit(row, tokens)
            results.append(DecodeResult(tokens=tokens, stats=stats))
        return results

    @staticmethod
    def _stats(
        calls: list[list[float]], prompt_len: int, new_tokens: int, start: float, end: float
    ) -> DecodeStats:
        stats = DecodeStats(
            prompt_len=prompt_len,
            total_s=end - start,
            prefill_s=calls[0][3] - start if calls else 0.0,
        )
        rounds = calls[1:]
        committed = [b[0] - a[0] for a, b in zip(rounds, rounds[1:])]
        committed.append(new_tokens - 1 - sum(committed))  # the last round: whatever was left
        prev_end = calls[0][3] if calls else start
        for (_, n_in, t0, t1), c in zip(rounds, committed):
            drafts = int(n_in) - 1
            stats.rounds.append(
                RoundStats(
                    accepted=max(min(c - 1, drafts), 0),
                    committed=int(c),
                    tree_size=drafts,
                    draft_s=t0 - prev_end,
                    verify_s=t1 - t0,
                )
            )
            prev_end = t1
        return stats


# ---------------------------------------------------------------------------------------
# builders


def _tree(ctx: MethodContext, name: str):
    return resolve_tree(name, ctx.tree_dirs)


def _vanilla(ctx: MethodContext, info, settings, name, runner) -> Method:
    return EngineMethod(name, info, ctx, runner)


def _prompt_lookup(ctx: MethodContext, info, s: PromptLookupSettings, name, runner) -> Method:
    from eagle.proposers import PromptLookupProposer

    return EngineMethod(
        name,
        info,
        ctx,
        runner,
        PromptLookupProposer(num_tokens=s.num_tokens, max_ngram=s.max_ngram),
    )


def _draft_model(ctx: MethodContext, s: DraftSettings, name: str) -> nn.Module:
    if not s.model:
        raise MethodError(f"method {name!r} needs a small draft LM (draft.model=DIR)")
    if ctx.draft_lm is None:
        raise MethodError(f"method {name!r} needs a draft LM loader in its context")
    draft = ctx.draft_lm(s.model)
    check_same_tokens(ctx, draft, s.model)
    return draft


def check_same_tokens(ctx: MethodContext, draft: nn.Module, draft_path: str) -> None:
    """A draft LM proposes token ids: they mean the same to the target only under the same
    tokenizer (compared by hash when the draft's folder has one) and the same vocabulary size."""
    from eagle.target import TargetError, lm_head, load_tokenizer, tokenizer_hash

    vocab, draft_vocab = lm_head(ctx.target).weight.shape[0], lm_head(draft).weight.shape[0]
    if draft_vocab != vocab:
        raise MethodError(
            f"the draft LM {draft_path} has a vocabulary of {draft_vocab}, the target "
            f"{ctx.target_path} {vocab}: set draft.model to a draft LM of the target's family"
        )
    if ctx.tokenizer is None:
        return
    try:
        draft_tokenizer = load_tokenizer(draft_path)
    except TargetError:  # no tokenizer in its folder: the vocabulary size is all there is to check
        return
    if tokenizer_hash(draft_tokenizer) != tokenizer_hash(ctx.tokenizer):
        raise MethodError(
            f"the draft LM {draft_path} uses another tokenizer than the target {ctx.target_path}"
        )


def _draft(ctx: MethodContext, info, s: DraftSettings, name, runner) -> Method:
    from eagle.proposers import DraftLM, TemplateProposer
    from eagle.proposers.eagle import pass_shape

    template = _tree(ctx, s.tree)
    compile_mode = (
        ctx.compile_mode if runner == "static" else None
    )  # compiled like EAGLE's drafter, or neither
    draft = DraftLM(
        _draft_model(ctx, s, name),
        cache=runner,
        compile_mode=compile_mode,
        pass_shape=pass_shape(template) if compile_mode is not None else None,
    )
    proposer = TemplateProposer(draft, template, proposal=s.proposal, name="draft")
    return EngineMethod(name, info, ctx, runner, proposer, tuple(template.parents))


def _specinfer_merge(ctx: MethodContext, info, s: MergeSettings, name, runner) -> Method:
    from eagle.proposers import DraftLM, TemplateProposer
    from eagle.proposers.merge import MergeProposer

    if not s.models:
        raise MethodError(
            f"method {name!r} needs its SSMs (specinfer.models=[DIR, ...]; make specinfer trains "
            "them)"
        )
    template = _tree(ctx, s.tree)
    ssms = [
        TemplateProposer(
            DraftLM(_draft_model(ctx, DraftSettings(model=path), name), cache=runner),
            template,
            proposal=s.proposal,
            name=f"ssm{k + 1}",
        )
        for k, path in enumerate(s.models)
    ]
    return EngineMethod(name, info, ctx, runner, MergeProposer(ssms, s.budget))


def _eagle(ctx: MethodContext, info, s: EagleSettings, name, runner) -> Method:
    proposer, template = _eagle_proposer(ctx, s, name, runner)
    return EngineMethod(name, info, ctx, runner, proposer, tuple(template.parents))


def _eagle_lookup(ctx: MethodContext, info, s: EagleLookupSettings, name, runner) -> Method:
    """EAGLE's tree and prompt lookup's chain merged by shared prefix into one tree a round
    (`MergeProposer`, exact as SpecInfer's merge is): the chain where the text repeats itself,
    the drafter elsewhere."""
    from eagle.proposers import PromptLookupProposer
    from eagle.proposers.merge import MergeProposer

    proposer, _ = _eagle_proposer(ctx, s, name, runner)
    lookup = PromptLookupProposer(
        num_tokens=s.num_tokens, max_ngram=s.max_ngram, min_ngram=s.min_ngram
    )
    return EngineMethod(name, info, ctx, runner, MergeProposer([proposer, lookup]))


def _eagle_proposer(ctx: MethodContext, s: EagleSettings, name: str, runner: str):
    """EAGLE's proposer for `s` (its drafter, tree and drafting vocabulary) and its tree template.
    """
    from eagle.models.checkpoint import load_drafter
    from eagle.models.drafter import EagleDrafter
    from eagle.proposers import eagle_proposer

    template = _tree(ctx, s.tree)
    if s.random:
        drafter = EagleDrafter.random(ctx.target, ctx.tokenizer, ctx.target_path)
    elif s.drafter:
        drafter = load_drafter(s.drafter, ctx.target, ctx.tokenizer, ctx.target_path)
    else:
        raise MethodError(
            f"method {name!r} needs a trained drafter (eagle.drafter=DIR) or, explicitly, "
            "eagle.random=true"
        )
    drafter.to(next(ctx.target.parameters()).dtype)
    backend_of(ctx.target).adopt(drafter)  # the drafter's own linears run the target's kernels
    if s.draft_vocab is not None:
        drafter.restrict_vocab(_draft_vocab(s, name, drafter.config.vocab_size))
    compile_mode = ctx.compile_mode if runner == "static" else None
    return eagle_proposer(
        drafter, template, proposal=s.proposal, cache=runner, compile_mode=compile_mode
    ), template


def _draft_vocab(s: EagleSettings, name: str, vocab_size: int):
    """The K token ids of `eagle.draft_vocab`, from the counts saved beside the drafter."""
    from eagle.data.vocab import draft_vocabulary, load_counts

    counts = None if s.random else load_counts(s.drafter, vocab_size)
    if counts is None:
        raise MethodError(
            f"method {name!r}: eagle.draft_vocab needs the token counts of the drafter's training "
            f"data (token_counts.safetensors, written by training; for another drafter: python -m "
            f"eagle.data.vocab --features DUMP --drafter {s.drafter or 'DIR'})"
        )
    try:
        ids, coverage = draft_vocabulary(counts, s.draft_vocab)
    except ValueError as err:
        raise MethodError(f"method {name!r}: eagle.draft_vocab: {err}") from None
    print(
        f"[{name}] drafting from {len(ids)} of {vocab_size} tokens ({coverage:.1%} of the "
        "drafter's "
        "training tokens)",
        flush=True,
    )
    return ids


def _medusa(ctx: MethodContext, info, s: MedusaSettings, name, runner) -> Method:
    from eagle.models.checkpoint import load_medusa
    from eagle.models.medusa import MedusaHeads
    from eagle.proposers import medusa_proposer

    template = _tree(ctx, s.tree)
    if s.random:
        heads = MedusaHeads.random(ctx.target, template.depth, ctx.tokenizer, ctx.target_path)
    elif s.heads:
        heads = load_medusa(
            s.heads, ctx.target, ctx.tokenizer, ctx.target_path
        )  # in the target's dtype
    else:
        raise MethodError(
            f"method {name!r} needs trained Medusa heads (medusa.heads=DIR) or, explicitly, "
            f"medusa.random=true"
        )
    backend_of(ctx.target).adopt(heads)
    typical = TypicalAcceptance(s.typical_eps, s.typical_delta) if info.lossy else None
    return EngineMethod(
        name,
        info,
        ctx,
        runner,
        medusa_proposer(heads, template, proposal=s.proposal),
        tuple(template.parents),
        typical=typical,
    )


def _hf_generate(ctx: MethodContext, info, settings, name, runner) -> Method:
    return HFMethod(name, info, ctx.target, ctx.eos)


def _hf_assisted(ctx: MethodContext, info, s: DraftSettings, name, runner) -> Method:
    return HFMethod(name, info, ctx.target, ctx.eos, assistant_model=_draft_model(ctx, s, name))


def _hf_prompt_lookup(ctx: MethodContext, info, s: PromptLookupSettings, name, runner) -> Method:
    return HFMethod(
        name,
        info,
        ctx.target,
        ctx.eos,
        prompt_lookup_num_tokens=s.num_tokens,
        max_matching_ngram_size=s.max_ngram,
    )


@dataclass(frozen=True)
class MethodInfo:
    """A registry entry: how to build a method and what it is."""

    build: Callable[..., Method]
    settings: type | None = None  # its typed settings class
    # the decode config's section holding them (shared by related methods)
    section: str | None = None
    takes_tree: bool = False  # NAME@TREE
    needs_draft_lm: bool = False
    lossy: str | None = None  # why it does not preserve the target's distribution
    wide: bool = False  # verifies a wide tree every round: bf16 pays off where it is fast
    engine: bool = True  # runs in our loop (runner options apply); False: Hugging Face's generate


METHODS: dict[str, MethodInfo] = {
    "vanilla": MethodInfo(_vanilla),
    "eagle": MethodInfo(_eagle, EagleSettings, "eagle", takes_tree=True, wide=True),
    "eagle_lookup": MethodInfo(
        _eagle_lookup, EagleLookupSettings, "eagle_lookup", takes_tree=True, wide=True
    ),
    "draft": MethodInfo(_draft, DraftSettings, "draft", takes_tree=True, needs_draft_lm=True),
    "specinfer_merge": MethodInfo(
        _specinfer_merge, MergeSettings, "specinfer", takes_tree=True, needs_draft_lm=True
    ),
    "prompt_lookup": MethodInfo(_prompt_lookup, PromptLookupSettings, "prompt_lookup"),
    "medusa": MethodInfo(_medusa, MedusaSettings, "medusa", takes_tree=True, wide=True),
    "medusa_typical": MethodInfo(
        _medusa, MedusaSettings, "medusa", takes_tree=True, wide=True, lossy="typical acceptance"
    ),
    "hf_generate": MethodInfo(_hf_generate, engine=False),
    "hf_assisted": MethodInfo(
        _hf_assisted, DraftSettings, "draft", needs_draft_lm=True, engine=False
    ),
    "hf_prompt_lookup": MethodInfo(
        _hf_prompt_lookup, PromptLookupSettings, "prompt_lookup", engine=False
    ),
}
SECTIONS = sorted(
    {info.section for info in METHODS.values() if info.section}
)  # decode config sections


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name `NAME[@TREE][%K][:RUNNER]` (see the module docstring)."""

    base: str
    tree: str | None = None
    runner: str | None = None
    draft_vocab: int | None = None

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        rest, colon, runner = str(text).partition(":")
        rest, pct, vocab = rest.partition("%")
        base, at, tree = rest.partition("@")
        if base not in METHODS:
            raise MethodError(
                f"unknown method {text!r}; choose one of {', '.join(METHODS)} "
                f"(as NAME[@TREE][%K][:RUNNER])"
            )
        info = METHODS[base]
        if pct and not (info.settings and issubclass(info.settings, EagleSettings)):
            raise MethodError(
                f"method {text!r}: %K (a draft vocabulary of K tokens) is for eagle and "
                "eagle_lookup "
                f"only, as eagle%1024"
            )
        if pct and (not vocab.isdigit() or int(vocab) < 1):
            raise MethodError(
                f"method {text!r}: K must be a positive integer, as eagle%1024 "
                f"(in this order: NAME[@TREE][%K][:RUNNER])"
            )
        if at and not info.takes_tree:
            takes = ", ".join(k for k, v in METHODS.items() if v.takes_tree)
            raise MethodError(f"method {text!r}: only {takes} take a tree, as NAME@TREE")
        if at and not tree:
            raise MethodError(f"method {text!r}: no tree name after @ (as {base}@chain5)")
        if colon:
            if not info.engine:
                raise MethodError(
                    f"method {text!r}: {base} runs Hugging Face's generate, which takes no runner"
                )
            if runner not in RUNNERS:
                raise MethodError(
                    f"method {text!r}: unknown runner {runner!r}; choose one of {RUNNERS}"
                )
        return cls(base, tree or None, runner or None, int(vocab) if pct else None)

    @property
    def info(self) -> MethodInfo:
        return METHODS[self.base]

    def __str__(self) -> str:
        return (
            self.base
            + (f"@{self.tree}" if self.tree else "")
            + (f"%{self.draft_vocab}" if self.draft_vocab else "")
            + (f":{self.runner}" if self.runner else "")
        )


def short(label: str) -> str:
    """A method label with a tree file's path cut to its name (`eagle@runs/x/machine_b{B}.yaml%4096`
    -> `eagle@machine_b{B}%4096`), for tables and plots; the report keeps the whole label."""
    return re.sub(r"@(?:[^@%:]*/)?([^/@%:]+?)(?:\.ya?ml)?(?=$|[%:])", r"@\1", label)


def method_settings(spec: MethodSpec, sections: Mapping[str, Mapping[str, Any]]):
    """The typed settings of `spec` from the config `sections` (`section name -> mapping`),
    with the spec's tree; unknown keys are an error, not ignored."""
    info = spec.info
    if info.settings is None:
        return None
    raw = dict(sections.get(info.section) or {})
    known = {f.name for f in dataclasses.fields(info.settings)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise MethodError(f"{info.section}: unknown setting(s) {unknown}; known: {sorted(known)}")
    settings = info.settings(**raw)
    settings = replace(settings, tree=spec.tree) if spec.tree else settings
    return replace(settings, draft_vocab=spec.draft_vocab) if spec.draft_vocab else settings


def build_method(
    spec: str | MethodSpec,
    ctx: MethodContext,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
) -> Method:
    """Build the method `spec` names against `ctx`, with its settings from `sections`."""
    spec = MethodSpec.parse(spec) if isinstance(spec, str) else spec
    info = spec.info
    runner = spec.runner or ctx.runner
    if info.engine and runner not in RUNNERS:
        raise MethodError(f"unknown runner {runner!r}; choose one of {RUNNERS}")
    return info.build(ctx, info, method_settings(spec, sections or {}), str(spec), runner)


def method_dtype(spec: str | MethodSpec, device, overrides: Mapping[str, str] | None = None) -> str:
    """The dtype a method runs in: `overrides[label]` or `overrides[base name]`, else the
    machine's choice (`eagle.hardware.auto_dtype`; wide-tree methods may take bf16 on a CPU)."""
    spec = MethodSpec.parse(spec) if isinstance(spec, str) else spec
    overrides = overrides or {}
    chosen = overrides.get(str(spec)) or overrides.get(spec.base)
    wide = spec.info.wide
    return resolve_dtype_name(chosen, device, wide) if chosen else auto_dtype(device, wide)


def dtype_overrides(spec: Mapping[str, str] | Sequence[str] | None) -> dict[str, str]:
    """`benchmark.dtypes` as {method label or base name: dtype}. Given as a mapping
    (`benchmark.dtypes={eagle:float32}`) or as a list of LABEL=DTYPE strings: Hydra's override
    grammar cannot spell labels such as `eagle@chain5` or `vanilla:dynamic` as keys
    (`'benchmark.dtypes=["vanilla:dynamic=bfloat16"]'`)."""
    if not spec:
        return {}
    if isinstance(spec, Mapping):
        return {str(k): str(v) for k, v in spec.items()}
    out = {}
    for item in spec:
        label, eq, dtype = str(item).rpartition("=")
        if not eq or not label or not dtype:
            raise ValueError(
                f"benchmark.dtypes: {item!r} is not LABEL=DTYPE (e.g. vanilla:dynamic=bfloat16)"
            )
        out[label] = dtype
    return out

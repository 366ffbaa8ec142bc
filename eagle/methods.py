"""Decoding methods by name, behind one interface, so the benchmark runs them side by side.

Engine methods (through `eagle.engine.SpeculativeDecoder`):
  vanilla, eagle, draft (classic speculative decoding with a small LM), prompt_lookup,
  medusa (Medusa-1 heads, exact verification): all exact;
  medusa_typical (Medusa-1 heads, typical acceptance): LOSSY under sampling, labelled so;
  vanilla_static, eagle_static: vanilla and eagle on preallocated, position-indexed caches with
  fixed shapes every round (`eagle.target_runner.StaticRunner`), optionally compiled; exact.
Hugging Face peers (through `model.generate`):
  hf_generate, hf_assisted (assisted generation with the same small LM), hf_prompt_lookup.

Every method reports tau the same way: tokens committed per target forward after the
prefill (for HF methods, target forwards are counted with a forward hook).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from eagle.acceptance import TypicalAcceptance
from eagle.engine import DecodeStats, Proposer, SpeculativeDecoder
from eagle.sampling import SamplingPolicy
from eagle.target_runner import StaticRunner, TargetRunner

ENGINE_METHODS = ("vanilla", "eagle", "draft", "prompt_lookup", "medusa", "medusa_typical", "vanilla_static",
                  "eagle_static")
HF_METHODS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
METHODS = ENGINE_METHODS + HF_METHODS
TREE_METHODS = ("eagle", "draft", "eagle_static")  # take a tree: `eagle@chain5` is eagle with configs/tree/chain5.yaml
# verify a wide tree every round: bf16 pays off for them on a CPU with bf16 instructions
WIDE_METHODS = ("eagle", "eagle_static", "medusa", "medusa_typical")


class MethodError(ValueError):
    """A method that cannot be built as configured."""


@dataclass
class Outcome:
    """One generation: the new tokens and where the time went."""

    tokens: list[int]
    seconds: float
    forwards: int                     # target forwards after the prefill
    draft_s: float = 0.0
    prefill_s: float = 0.0            # engine methods: the prompt's forward and first token (HF: 0, unknown)
    verify_s: float = 0.0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per round
    paths: list[tuple[int, ...]] = field(default_factory=list)  # accepted node indices per round
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes scored per round

    @property
    def tau(self) -> float:
        return (len(self.tokens) - 1) / max(self.forwards, 1)


class Method:
    """A named way to decode with a target."""

    name: str = "method"
    lossy: str | None = None  # why the output distribution differs from the target's; None: lossless
    tree_parents: tuple[int, ...] | None = None  # the fixed draft tree's parent list, if any

    @property
    def lossless(self) -> bool:
        """Distribution-preserving by construction (proved by the test suite)."""
        return self.lossy is None

    def __init__(self, name: str, target: nn.Module, eos_token_id):
        self.name, self.target, self.eos_token_id = name, target, eos_token_id

    def generate(self, prompt: list[int], max_new_tokens: int, policy: SamplingPolicy,
                 generator: torch.Generator | None = None, on_commit=None) -> Outcome:
        raise NotImplementedError


class EngineMethod(Method):
    """A proposer run by the speculative loop (vanilla when `proposer` is None); exact
    verification unless `typical` asks for Medusa's typical acceptance (lossy).

    `runner`: kept across generations (a static runner's buffers and compiled graphs are
    reused); None gives every generation a fresh growing cache."""

    def __init__(self, name: str, target: nn.Module, eos_token_id, proposer: Proposer | None = None,
                 tree_size: int = 0, tree_parents: tuple[int, ...] | None = None,
                 typical: TypicalAcceptance | None = None, runner: TargetRunner | None = None):
        super().__init__(name, target, eos_token_id)
        self.proposer, self.tree_size, self.tree_parents = proposer, tree_size, tree_parents
        self.typical, self.runner = typical, runner
        if typical is not None:
            self.lossy = "typical acceptance"

    def generate(self, prompt, max_new_tokens, policy, generator=None, on_commit=None) -> Outcome:
        decoder = SpeculativeDecoder(self.target, self.proposer, policy, eos_token_id=self.eos_token_id,
                                     typical=self.typical, runner=self.runner)
        res = decoder.generate(prompt, max_new_tokens, generator=generator, tree_size_hint=self.tree_size,
                               on_commit=on_commit)
        return outcome_from_stats(res.tokens, res.stats)


def outcome_from_stats(tokens: list[int], stats: DecodeStats) -> Outcome:
    return Outcome(tokens=tokens, seconds=stats.total_s, forwards=len(stats.rounds), draft_s=stats.draft_s,
                   prefill_s=stats.prefill_s,
                   verify_s=stats.verify_s, accepted=[r.accepted for r in stats.rounds],
                   paths=[r.path for r in stats.rounds], tree_sizes=[r.tree_size for r in stats.rounds])


class HFMethod(Method):
    """`model.generate` with optional assisted generation or prompt lookup."""

    def __init__(self, name: str, target: nn.Module, eos_token_id, **generate_kwargs):
        super().__init__(name, target, eos_token_id)
        self.generate_kwargs = generate_kwargs
        self._forwards = 0

    def _count(self, module, args):
        self._forwards += 1

    def generate(self, prompt, max_new_tokens, policy, generator=None, on_commit=None) -> Outcome:
        device = next(self.target.parameters()).device
        ids = torch.tensor([prompt], device=device)
        sampling = {"do_sample": False} if policy.greedy else {
            "do_sample": True, "temperature": policy.temperature, "top_k": policy.top_k, "top_p": policy.top_p}
        if generator is not None and not policy.greedy:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        eos = self.eos_token_id if self.eos_token_id is not None else []
        self._forwards = 0
        hook = self.target.register_forward_pre_hook(self._count)  # counts target forwards for tau
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                           eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else 0,
                                           **sampling, **self.generate_kwargs)
        finally:
            hook.remove()
        seconds = time.perf_counter() - start
        tokens = out[0, len(prompt):].tolist()
        if on_commit:
            on_commit(tokens)
        return Outcome(tokens=tokens, seconds=seconds, forwards=max(self._forwards - 1, 1))


@dataclass
class MethodSpec:
    """Everything needed to build any method (unused fields are ignored)."""

    tree: str = "eagle_default"          # tree template name or path for eagle
    draft_tree: str = "chain5"           # template for the draft LM (classic SD drafts a chain)
    proposal: str = "sample"             # "sample" | "topk": how children are drawn under sampling
    drafter: str | None = None           # EAGLE checkpoint directory
    random_drafter: bool = False         # explicit: decode with an untrained drafter (losslessness checks)
    prompt_lookup_tokens: int = 10
    prompt_lookup_ngram: int = 2
    medusa: str | None = None            # Medusa heads checkpoint directory
    random_medusa: bool = False          # explicit: untrained heads, one per depth of medusa_tree
    medusa_tree: str = "medusa_default"  # sparse tree template for the Medusa heads
    typical_eps: float = 0.09            # medusa_typical: Medusa's posterior_threshold
    typical_delta: float = 0.3           # medusa_typical: Medusa's posterior_alpha
    tree_dirs: tuple[str, ...] = ()
    static_max_len: int | None = None    # *_static: cache slots; None = per sequence, rounded up to 256
    compile_mode: str | None = None      # *_static: None (eager), "default", "reduce-overhead" (CUDA graphs)


def method_dtype(name: str, device, overrides: dict | None = None) -> str:
    """The dtype `name` runs in: `overrides[name]` (or of its base method), else the machine's
    choice (`eagle.hardware.auto_dtype`; wide-tree methods may take bf16 on a CPU)."""
    from eagle.hardware import auto_dtype, resolve_dtype_name

    base = parse_method(name)[0]
    overrides = overrides or {}
    wide = base in WIDE_METHODS
    chosen = overrides.get(name) or overrides.get(base)
    return resolve_dtype_name(chosen, device, wide) if chosen else auto_dtype(device, wide)


def parse_method(name: str) -> tuple[str, str | None]:
    """`"eagle@best25"` -> ("eagle", "best25"): a tree method with another tree, so that
    several trees run side by side in one benchmark. Plain names give (name, None)."""
    base, at, tree = name.partition("@")
    if base not in METHODS:
        raise MethodError(f"unknown method {name!r}; choose one of {', '.join(METHODS)} "
                          f"(or {'|'.join(TREE_METHODS)}@TREE)")
    if at and (base not in TREE_METHODS or not tree):
        raise MethodError(f"method {name!r}: only {', '.join(TREE_METHODS)} take a tree, as NAME@TREE")
    return base, tree or None


def build_method(name: str, target: nn.Module, tokenizer, spec: MethodSpec, target_path: str | None = None,
                 draft_model: nn.Module | None = None) -> Method:
    """Build a method by name (`eagle@TREE` and `draft@TREE` override the spec's tree);
    raises MethodError naming what is missing."""
    from eagle.proposers import DraftLM, PromptLookupProposer, TemplateProposer
    from eagle.tree import resolve_tree

    eos = tokenizer.eos_token_id if tokenizer is not None else None
    name, tree = parse_method(name)
    if tree is not None:
        spec = replace(spec, **{"draft_tree" if name == "draft" else "tree": tree})
        method = build_method(name, target, tokenizer, spec, target_path, draft_model)
        method.name = f"{name}@{tree}"
        return method
    if name == "vanilla":
        return EngineMethod(name, target, eos)
    if name == "vanilla_static":
        return EngineMethod(name, target, eos, runner=StaticRunner(
            target, tree_size=0, max_len=spec.static_max_len, compile_mode=spec.compile_mode))
    if name == "prompt_lookup":
        proposer = PromptLookupProposer(num_tokens=spec.prompt_lookup_tokens, max_ngram=spec.prompt_lookup_ngram)
        return EngineMethod(name, target, eos, proposer, tree_size=spec.prompt_lookup_tokens)
    if name == "hf_generate":
        return HFMethod(name, target, eos)
    if name == "hf_prompt_lookup":
        return HFMethod(name, target, eos, prompt_lookup_num_tokens=spec.prompt_lookup_tokens)
    if name in ("draft", "hf_assisted"):
        if draft_model is None:
            raise MethodError(f"method {name!r} needs a small draft LM (set draft_lm to a model directory)")
        if name == "hf_assisted":
            return HFMethod(name, target, eos, assistant_model=draft_model)
        template = resolve_tree(spec.draft_tree, spec.tree_dirs)
        proposer = TemplateProposer(DraftLM(draft_model), template, proposal=spec.proposal, name="draft")
        return EngineMethod(name, target, eos, proposer, tree_size=template.num_nodes,
                            tree_parents=tuple(template.parents))
    if name in ("medusa", "medusa_typical"):
        return _medusa_method(name, target, tokenizer, eos, spec, target_path)
    # eagle, eagle_static
    from eagle.checkpoint import load_drafter
    from eagle.drafter import EagleDrafter
    from eagle.proposers.eagle import eagle_proposer

    template = resolve_tree(spec.tree, spec.tree_dirs)
    if spec.random_drafter:
        drafter = EagleDrafter.random(target, tokenizer, target_path)
    elif spec.drafter:
        drafter = load_drafter(spec.drafter, target, tokenizer, target_path)
    else:
        raise MethodError(f"method {name!r} needs a trained drafter (drafter_path=DIR) or, explicitly, "
                          "random_drafter=true")
    drafter.to(next(target.parameters()).dtype)
    static = name == "eagle_static"
    compile_mode = spec.compile_mode if static else None
    proposer = eagle_proposer(drafter, template, proposal=spec.proposal, static=static, compile_mode=compile_mode)
    runner = StaticRunner(target, tree_size=template.num_nodes, max_len=spec.static_max_len,
                          compile_mode=compile_mode) if static else None
    return EngineMethod(name, target, eos, proposer, tree_size=template.num_nodes,
                        tree_parents=tuple(template.parents), runner=runner)


def _medusa_method(name: str, target: nn.Module, tokenizer, eos, spec: MethodSpec,
                   target_path: str | None) -> Method:
    """Medusa-1 heads on `spec.medusa_tree`; exact verification, or typical acceptance (lossy)."""
    from eagle.checkpoint import load_medusa
    from eagle.medusa import MedusaHeads
    from eagle.proposers.medusa import medusa_proposer
    from eagle.tree import resolve_tree

    template = resolve_tree(spec.medusa_tree, spec.tree_dirs)
    if spec.random_medusa:
        heads = MedusaHeads.random(target, template.depth, tokenizer, target_path)
    elif spec.medusa:
        heads = load_medusa(spec.medusa, target, tokenizer, target_path)
    else:
        raise MethodError(f"method {name!r} needs trained Medusa heads (medusa_path=DIR) or, explicitly, "
                          f"random_medusa=true")
    # both in the target's dtype and on its device
    typical = TypicalAcceptance(spec.typical_eps, spec.typical_delta) if name == "medusa_typical" else None
    proposer = medusa_proposer(heads, template, proposal=spec.proposal)
    return EngineMethod(name, target, eos, proposer, tree_size=template.num_nodes,
                        tree_parents=tuple(template.parents), typical=typical)

"""One speculative decoding loop for every method, vanilla decoding included.

Each round:
  1. the proposer drafts a tree of candidate tokens under the root (the last committed
     token, whose KV is not yet in the target cache), with the proposal `q` each was drawn from;
  2. the target scores root + tree in ONE forward on top of its committed KV cache, with a
     tree attention mask and depth-based position ids;
  3. verification accepts a root-to-node path and emits one more token (the target's
     correction, or the bonus token at a leaf), greedy or by SpecInfer's multi-round rule;
     or, only when asked for (`typical=`), by Medusa's typical acceptance, which is LOSSY;
  4. only the accepted path's KV stays in the target cache; the proposer is told the path.

How the target runs and keeps its KV is the runner's business (`eagle.decoding.runners`): a
growing Hugging Face cache (`DynamicRunner`, the default) or a preallocated, position-indexed
one with fixed shapes that can be compiled (`StaticRunner`). The loop is the same.

Vanilla decoding is a proposer that drafts nothing: the same loop, cache and forward, so
speed ratios compare like with like. `tau` = tokens committed per verification forward
(bonus/correction token included; the prefill forward is not a round).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from eagle.acceptance import (
    TypicalAcceptance,
    verify_tree_greedy,
    verify_tree_stochastic,
    verify_tree_typical,
)
from eagle.decoding.runners import ContextOverflowError, DynamicRunner, TargetRunner
from eagle.decoding.stats import DecodeResult, DecodeStats, RoundStats
from eagle.sampling import RowProbs, SamplingPolicy, check_generator
from eagle.target import context_length

__all__ = ["ContextOverflowError", "DecodeResult", "DecodeState", "DecodeStats", "DraftTree", "Proposer",
           "SpeculativeDecoder", "VanillaProposer"]


@dataclass
class DraftTree:
    """What a proposer returns: N draft tokens under the root, in breadth-first order.

    Attributes:
        tokens: (N,) long draft tokens (the root, node 0, is not included).
        parents: length N+1, parents[0] = -1, parents[i] < i; siblings are tried in index order.
        q: (N, V) the distribution each draft token was actually drawn from (one-hot for a
            deterministic choice); None under greedy decoding, where it is never needed.
        repeats: node i (1..N) -> (twins, (r, V) proposals): draws made right after node i
            that repeated the tokens of earlier siblings `twins` (a merged tree,
            `eagle.proposers.merge`); under sampling each is tried there, with its own
            proposal (`eagle.acceptance.node_outcomes`).
    """

    tokens: Tensor
    parents: tuple[int, ...]
    q: Tensor | None = None
    repeats: dict[int, tuple[tuple[int, ...], Tensor]] | None = None

    @property
    def size(self) -> int:
        return len(self.parents) - 1

    @classmethod
    def empty(cls, device=None) -> DraftTree:
        return cls(tokens=torch.empty(0, dtype=torch.long, device=device), parents=(-1,))


@dataclass
class DecodeState:
    """What proposers may read. The target features in `new_features` belong to the tokens
    that last entered the target cache; feature j pairs with token tokens[-k + j] (the token
    that follows it), which is exactly EAGLE's `[f_{t-1}; E(x_t)]` input."""

    tokens: list[int]
    prompt_len: int
    new_features: Tensor  # (1, k, H)
    policy: SamplingPolicy
    vocab_size: int
    generator: torch.Generator | None = None
    max_len: int = 0  # slots of the target's cache for this sequence: static draft caches match it


class Proposer:
    """Interface of a drafting method. Subclasses override `propose` (and usually the hooks)."""

    name = "proposer"
    max_nodes = 0  # the most draft nodes one round proposes (a static runner pads every tree to it)

    def reset(self, state: DecodeState) -> None:
        """Called once after the target's prefill, before the first round."""

    def propose(self, state: DecodeState) -> DraftTree:
        raise NotImplementedError

    def accept(self, state: DecodeState, tree: DraftTree, path: list[int]) -> None:
        """Told which path was accepted (node indices from the root) once it is committed."""


class VanillaProposer(Proposer):
    """Drafts nothing: plain autoregressive decoding through the speculative loop."""

    name = "vanilla"

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree.empty()


class SpeculativeDecoder:
    """Decode a target with any proposer, exactly (greedy or sampled) by default.

    Args:
        target: a Hugging Face causal LM (eval mode).
        proposer: the drafting method; None means vanilla decoding.
        policy: the sampling policy for both p (target) and q (proposer).
        eos_token_id: one id or several; decoding stops after the first one emitted.
        typical: Medusa's typical acceptance instead of the exact rules: LOSSY under sampling
            (the output no longer follows p); every token the target emits itself is its
            argmax. At temperature 0 it is greedy verification, exact.
        runner: how the target runs and keeps its KV; None is a fresh `DynamicRunner`.
    """

    def __init__(self, target: nn.Module, proposer: Proposer | None = None,
                 policy: SamplingPolicy | None = None, eos_token_id: int | Sequence[int] | None = None,
                 typical: TypicalAcceptance | None = None, runner: TargetRunner | None = None):
        self.target = target
        self.runner = runner or DynamicRunner(target)
        self.proposer = proposer or VanillaProposer()
        self.policy = policy or SamplingPolicy()
        self.typical = typical
        if eos_token_id is None:
            eos_token_id = getattr(target.generation_config, "eos_token_id", None)
        eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self.eos = set(eos)
        self.max_context = context_length(target)

    def check_fits(self, prompt_len: int, max_new_tokens: int, tree_size: int) -> None:
        check_fits(prompt_len, max_new_tokens, tree_size, self.max_context)

    @torch.inference_mode()
    def generate(self, input_ids: Tensor | Sequence[int], max_new_tokens: int,
                 generator: torch.Generator | None = None,
                 on_commit: Callable[[list[int]], None] | None = None) -> DecodeResult:
        """Generate up to `max_new_tokens` tokens after `input_ids` ((1, T) or a list).

        `on_commit` receives each committed block of tokens (streaming output).
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(f"generate decodes one sequence: give (T,) or (1, T) token ids, not {tuple(ids.shape)}")
        ids = ids.reshape(-1).tolist()
        tree_size = max(self.proposer.max_nodes, self.runner.tree_size)
        self.check_fits(len(ids), max_new_tokens, tree_size)
        device = next(self.target.parameters()).device
        if not self.policy.greedy:
            check_generator(generator, device)
        policy, stats, runner = self.policy, DecodeStats(prompt_len=len(ids)), self.runner
        start = time.perf_counter()

        # Prefill: the whole prompt enters the cache; its last logits give the first token.
        out = runner.prefill(torch.tensor([ids], device=device), len(ids) + max_new_tokens + tree_size + 1)
        first = self._sample(out.logits[0, -1], generator)
        state = DecodeState(tokens=ids + [first], prompt_len=len(ids), new_features=out.features,
                            policy=policy, vocab_size=out.logits.shape[-1], generator=generator,
                            max_len=runner.capacity)
        new_tokens = [first]
        if on_commit:
            on_commit([first])
        stats.prefill_s = time.perf_counter() - start
        if max_new_tokens <= 1 or first in self.eos:
            stats.total_s = time.perf_counter() - start
            return DecodeResult(tokens=new_tokens[:max_new_tokens], stats=stats)
        self.proposer.reset(state)

        while True:
            t0 = time.perf_counter()
            tree = self.proposer.propose(state)
            if not stats.rounds:
                check_tree(tree, state.vocab_size, self.proposer.name)
            _sync(device)  # GPU work is asynchronous: charge drafting kernels to drafting
            t1 = time.perf_counter()
            path, next_token, features = self._verify(state, tree, generator)
            t2 = time.perf_counter()

            block = tree.tokens[[i - 1 for i in path[1:]]].tolist() + [next_token]
            done = False
            room = max_new_tokens - len(new_tokens)
            for j, tok in enumerate(block):  # EOS or max_new_tokens may land inside the path
                if tok in self.eos or j + 1 >= room:
                    block, done = block[: j + 1], True
                    break
            new_tokens += block
            state.tokens += block
            state.new_features = features
            if on_commit:
                on_commit(block)
            stats.rounds.append(RoundStats(accepted=len(path) - 1, committed=len(block),
                                           tree_size=tree.size, draft_s=t1 - t0, verify_s=t2 - t1,
                                           path=tuple(path)))
            if done:
                break
            self.proposer.accept(state, tree, path)
            _sync(device)
            stats.rounds[-1].draft_s += time.perf_counter() - t2  # proposer bookkeeping is drafting work
        stats.total_s = time.perf_counter() - start
        return DecodeResult(tokens=new_tokens, stats=stats)

    def _sample(self, logits: Tensor, generator) -> int:
        if self.policy.greedy or self.typical is not None:  # typical: "first token greedy"
            return int(logits.argmax())
        return int(self.policy.sample(self.policy.probs(logits.float()), generator))

    def _verify(self, state: DecodeState, tree: DraftTree, generator):
        """Score root + tree in one target forward, accept a path, keep only its KV.

        Returns:
            (path, next_token, features): accepted node indices from the root, the token
            emitted after them, and the target features of the path's nodes (1, len(path), H).
        """
        device = next(self.target.parameters()).device
        root = torch.tensor([state.tokens[-1]], device=device)
        x = torch.cat([root, tree.tokens.to(device)])[None]  # (1, n)
        out = self.runner.verify(x, tree.parents)
        logits = out.logits[0]  # (n, V)
        parents = list(tree.parents)
        tokens = x[0]
        if self.policy.greedy:  # typical acceptance included: with a one-hot p it is greedy
            path, next_token = verify_tree_greedy(parents, tokens, logits.float())  # fp32 argmax is faster on CPU
        elif self.typical is not None:
            p = self.policy.probs(logits.float())  # (n, V) temperature-scaled p at every node
            path, next_token = verify_tree_typical(parents, tokens, p, self.typical.eps, self.typical.delta)
        else:
            p = RowProbs(self.policy, logits.float())  # (n, V), each row computed when the verifier reads it
            if tree.size == 0:
                q_full = logits.new_zeros(logits.shape, dtype=torch.float32)  # (1, V): the root's row is never read
            elif tree.q is None:
                raise ValueError(f"{self.proposer.name} gave no proposal distributions under sampling")
            else:
                q = tree.q.to(device=logits.device, dtype=torch.float32)
                q_full = torch.cat([q.new_zeros(1, q.shape[-1]), q])  # (n, V)
            path, next_token = verify_tree_stochastic(parents, tokens, p, q_full, generator, repeats=tree.repeats)
        self.runner.commit(path)
        return path, int(next_token), out.features[:, path]


def check_fits(prompt_len: int, max_new_tokens: int, tree_size: int, context: int | None) -> None:
    """Raise before decoding when a request cannot be served: an empty prompt, no new tokens, or
    prompt + new tokens + the verified tree (root included) past the target's `context`."""
    if prompt_len == 0:
        raise ValueError("empty prompt: give at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    need = prompt_len + max_new_tokens + tree_size + 1
    if context is not None and need > context:
        raise ContextOverflowError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + tree ({tree_size + 1}) = {need} "
            f"tokens exceed the target's context of {context}")


def check_tree(tree: DraftTree, vocab_size: int, proposer: str) -> None:
    """Raise ValueError when a draft tree does not fit the target's vocabulary of `vocab_size`
    (a draft model of another vocabulary): checked on a sequence's first round, where it would
    otherwise end in an index error deep in the verification."""
    if tree.size and not 0 <= int(tree.tokens.min()) <= int(tree.tokens.max()) < vocab_size:
        raise ValueError(f"{proposer} drafted token ids outside the target's vocabulary of {vocab_size}: "
                         "is the draft model made for another tokenizer?")
    if tree.q is not None and tree.q.shape[-1] != vocab_size:
        raise ValueError(f"{proposer} gave proposal distributions over {tree.q.shape[-1]} tokens, the target has "
                         f"{vocab_size}: is the draft model made for another tokenizer?")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

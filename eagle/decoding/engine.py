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

Several sequences decode together the same way (`generate_batch`): each has its own draft tree
(drafted by its own `fork` of the proposer, with its own caches, or by one pass over every
sequence for proposers that batch their model), every tree is verified in ONE target forward,
each sequence is accepted by the same rules as alone, and a sequence that finishes leaves the
batch. Decoding one sequence is a batch of one.

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
from eagle.sampling import RowProbs, SamplingPolicy, argmax, check_generator
from eagle.target import context_length, longrope_switch
from eagle.tree import Tree

__all__ = [
    "ContextOverflowError",
    "DecodeResult",
    "DecodeState",
    "DecodeStats",
    "DraftTree",
    "Proposer",
    "SpeculativeDecoder",
    "VanillaProposer",
]


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
    # the most positions its own model reads (a draft LM's), None: no limit
    context: int | None = None

    def reset(self, state: DecodeState) -> None:
        """Called once after the target's prefill, before the first round."""

    def propose(self, state: DecodeState) -> DraftTree:
        raise NotImplementedError

    def accept(self, state: DecodeState, tree: DraftTree, path: list[int]) -> None:
        """Told which path was accepted (node indices from the root) once it is committed."""

    def fork(self) -> Proposer:
        """A proposer for one more sequence decoded beside this one's (a batch): the same models
        and settings, its own state (caches, histories). Stateless proposers return a copy."""
        raise NotImplementedError(
            f"{self.name} cannot draft for several sequences at once: it has no fork()"
        )

    def for_batch(self, n: int) -> list[Proposer]:
        """This proposer and n - 1 forks of it, one per sequence of a batch. The forks are kept
        for the next batch, so that their buffers (and compiled passes) are reused."""
        forks = self.__dict__.setdefault("_forks", [])
        while len(forks) < n - 1:
            forks.append(self.fork())
        return [self, *forks[: n - 1]]

    # A batch: the loop talks to the method's proposer through these three. By default every
    # sequence gets its own fork, and they draft one after another; a proposer that drafts for
    # several sequences in one pass of its model overrides them (`TemplateProposer` with EAGLE).

    def reset_batch(self, states: Sequence[DecodeState]) -> None:
        """A batch of sequences starts (their prompts are in the target's cache)."""
        self._rows = self.for_batch(len(states))
        for proposer, state in zip(self._rows, states):
            proposer.reset(state)

    def propose_batch(self, states: Sequence[DecodeState]) -> list[DraftTree]:
        """One tree per sequence still decoding (`states`, in batch order)."""
        return [proposer.propose(state) for proposer, state in zip(self._rows, states)]

    def accept_batch(
        self,
        states: Sequence[DecodeState],
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        keep: Sequence[int],
    ) -> None:
        """Told each sequence's accepted path; only the sequences `keep` (indices into `states`)
        go on, the others finished."""
        for i in keep:
            self._rows[i].accept(states[i], trees[i], paths[i])
        self._rows = [self._rows[i] for i in keep]


class VanillaProposer(Proposer):
    """Drafts nothing: plain autoregressive decoding through the speculative loop."""

    name = "vanilla"

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree.empty()

    def fork(self) -> VanillaProposer:
        return VanillaProposer()


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

    def __init__(
        self,
        target: nn.Module,
        proposer: Proposer | None = None,
        policy: SamplingPolicy | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        typical: TypicalAcceptance | None = None,
        runner: TargetRunner | None = None,
    ):
        self.target = target
        self.runner = runner or DynamicRunner(target)
        self.proposer = proposer or VanillaProposer()
        self.policy = policy or SamplingPolicy()
        self.typical = typical
        if eos_token_id is None:
            eos_token_id = getattr(target.generation_config, "eos_token_id", None)
        eos = (
            []
            if eos_token_id is None
            else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        )
        self.eos = set(eos)
        self.max_context = context_length(target)

    def check_fits(self, prompt_len: int, max_new_tokens: int, tree_size: int) -> None:
        check_fits(prompt_len, max_new_tokens, tree_size, self.max_context)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Tensor | Sequence[int],
        max_new_tokens: int,
        generator: torch.Generator | None = None,
        on_commit: Callable[[list[int]], None] | None = None,
    ) -> DecodeResult:
        """Generate up to `max_new_tokens` tokens after `input_ids` ((1, T) or a list).

        `on_commit` receives each committed block of tokens (streaming output).
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(
                "generate decodes one sequence: give (T,) or (1, T) token ids, not "
                f"{tuple(ids.shape)} "
                "(generate_batch decodes several)"
            )
        stream = None if on_commit is None else (lambda row, block: on_commit(block))
        return self.generate_batch([ids.reshape(-1).tolist()], max_new_tokens, generator, stream)[0]

    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        generator: torch.Generator | None = None,
        on_commit: Callable[[int, list[int]], None] | None = None,
    ) -> list[DecodeResult]:
        """Decode several sequences at once: every round, each one's draft tree, verified in ONE
        target forward for all of them, each by the same exact rules as alone.

        Args:
            prompts: B prompts of token ids, of any lengths.
            max_new_tokens: for every sequence, or one per sequence.
            generator: draws every sequence's samples, in row order (each follows the target's
                distribution; they are not the draws a batch of one would make).
            on_commit: receives (row, block) for each committed block of tokens.
        Returns:
            one `DecodeResult` per prompt, in order; a sequence that finishes (EOS, its
            max_new_tokens) leaves the batch, so its time is the time it took until then.
        """
        with self.runner.decoding():  # the weights stay fixed for the call (the runner's backend)
            return self._generate_batch(prompts, max_new_tokens, generator, on_commit)

    def _generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        generator: torch.Generator | None,
        on_commit: Callable[[int, list[int]], None] | None,
    ) -> list[DecodeResult]:
        prompts = [list(map(int, p)) for p in prompts]
        budgets = (
            [max_new_tokens] * len(prompts)
            if isinstance(max_new_tokens, int)
            else list(max_new_tokens)
        )
        if not prompts or len(budgets) != len(prompts):
            raise ValueError(
                f"generate_batch needs prompts and one max_new_tokens for all or one each, got "
                f"{len(prompts)} prompts and {len(budgets)} budgets"
            )
        runner, policy = self.runner, self.policy
        tree_size = max(self.proposer.max_nodes, runner.tree_size)
        vocab = self.target.get_input_embeddings().weight.shape[0]
        switch = longrope_switch(self.target)
        check_longrope([len(ids) for ids in prompts], budgets, tree_size, switch)
        # One sequence is served wherever plain decoding would be: near the context's end its rounds
        # verify no tree (`_within_context`); a draft LM still needs its tree's room in its own
        # context (below), where its positions may be a table. A batch's rows share slots past their
        # own lengths (each padded to the round's widest tree, a ragged batch to its longest row),
        # so a batch keeps room for a whole tree.
        alone = len(prompts) == 1
        for row, (ids, budget) in enumerate(zip(prompts, budgets)):
            self.check_fits(len(ids), budget, 0 if alone else tree_size)
            if (
                self.proposer.context is not None
            ):  # a draft LM of a shorter context: an index error mid-decode
                check_fits(
                    len(ids),
                    budget,
                    tree_size,
                    self.proposer.context,
                    f"{self.proposer.name}'s draft model",
                )
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:  # else an IndexError deep in the embedding (a device-side assert on a GPU)
                raise ValueError(
                    f"prompt {row} holds token ids outside the target's vocabulary of {vocab}: "
                    f"{bad[:5]} (tokenised for another model?)"
                )
        device = next(self.target.parameters()).device
        if not policy.greedy:
            check_generator(generator, device)
        proposer = self.proposer
        stats = [DecodeStats(prompt_len=len(ids)) for ids in prompts]
        start = time.perf_counter()

        # Prefill: every prompt enters the cache (right-padded); its last logits give the first
        # token.
        width = max(map(len, prompts))
        padded = torch.tensor(
            [ids + [ids[-1]] * (width - len(ids)) for ids in prompts], device=device
        )  # (B, T)
        out = runner.prefill(
            padded,
            max(len(ids) + b for ids, b in zip(prompts, budgets)) + tree_size + 1,
            lengths=[len(ids) for ids in prompts],
        )
        states, new_tokens, live = [], [], []
        for row, ids in enumerate(prompts):
            first = self._sample(out.logits[row, -1], generator)
            states.append(
                DecodeState(
                    tokens=ids + [first],
                    prompt_len=len(ids),
                    new_features=out.features[row : row + 1, : len(ids)],
                    policy=policy,
                    vocab_size=out.logits.shape[-1],
                    generator=generator,
                    max_len=runner.capacity,
                )
            )
            new_tokens.append([first])
            if on_commit:
                on_commit(row, [first])
            if budgets[row] > 1 and first not in self.eos:
                live.append(row)
        now = time.perf_counter()
        for row, s in enumerate(stats):
            s.prefill_s = now - start
            if row not in live:
                s.total_s = now - start
        if 0 < len(live) < len(prompts):
            runner.retire(live)  # row indices are still those of the prompts
        if live:
            proposer.reset_batch([states[row] for row in live])
        # a longrope target's one sequence below its switch, which it may cross (check_longrope)
        below = (
            switch
            if switch is not None and len(prompts) == 1 and len(prompts[0]) <= switch
            else None
        )

        while live:
            t0 = time.perf_counter()
            trees = proposer.propose_batch([states[row] for row in live])
            for row, tree in zip(live, trees):
                if not stats[row].rounds:
                    check_tree(tree, states[row].vocab_size, proposer.name)
            _sync(device)  # GPU work is asynchronous: charge drafting kernels to drafting
            t1 = time.perf_counter()
            verifying = trees
            if below is not None and live:
                verifying, below = self._at_switch(states[live[0]], trees, below)
            if alone:
                verifying = self._within_context(states[0], verifying)
            verified = self._verify([states[row] for row in live], verifying, generator)
            t2 = time.perf_counter()

            going = []
            for i, (row, tree, (path, next_token, features)) in enumerate(
                zip(live, verifying, verified)
            ):
                block, done = self._cut(
                    tree.tokens[[j - 1 for j in path[1:]]].tolist() + [next_token],
                    budgets[row] - len(new_tokens[row]),
                )
                new_tokens[row] += block
                states[row].tokens += block
                states[row].new_features = features
                if on_commit:
                    on_commit(row, block)
                # the round's drafting is shared by the sequences it drafted for (one after another,
                # or at once)
                stats[row].rounds.append(
                    RoundStats(
                        accepted=len(path) - 1,
                        committed=len(block),
                        tree_size=tree.size,
                        draft_s=(t1 - t0) / len(live),
                        verify_s=t2 - t1,
                        path=tuple(path),
                    )
                )
                if done:
                    stats[row].total_s = time.perf_counter() - start
                else:
                    going.append(i)
            if 0 < len(going) < len(live):  # finished sequences leave the batch
                runner.retire(going)
            if going:
                t3 = time.perf_counter()
                proposer.accept_batch(
                    [states[row] for row in live], trees, [path for path, _, _ in verified], going
                )
                _sync(device)
                bookkeeping = (time.perf_counter() - t3) / len(going)
                for i in going:  # proposer bookkeeping is drafting work
                    stats[live[i]].rounds[-1].draft_s += bookkeeping
            live = [live[i] for i in going]
        return [DecodeResult(tokens=t, stats=s) for t, s in zip(new_tokens, stats)]

    def _within_context(self, state: DecodeState, trees: list[DraftTree]) -> list[DraftTree]:
        """One sequence's trees to verify this round: none where the root and the tree would run
        past the target's context (slots and positions alike: the root sits at slot len - 1 and the
        tree's nodes after it). That round is a plain step, exact as any, and the proposer hears
        that nothing was accepted, as at a longrope switch (`_at_switch`)."""
        if self.max_context is None or len(state.tokens) + trees[0].size <= self.max_context:
            return trees
        return [DraftTree.empty(trees[0].tokens.device)]

    def _at_switch(
        self, state: DecodeState, trees: list[DraftTree], switch: int
    ) -> tuple[list[DraftTree], int | None]:
        """A longrope target's sequence below its `switch` (`eagle.target.longrope_switch`): the
        trees to verify this round, and the switch if the sequence is still below it. A forward
        whose longest position reaches the switch rotates every position with the long factors:
        a tree that would reach it is not verified (the round is a plain step, and the proposer
        hears that nothing was accepted), and the round whose root reaches it first recomputes
        the whole cache, rotated long, as Hugging Face's `generate` does there."""
        root = len(state.tokens) - 1  # the root's position
        if root >= switch:
            self.runner.recompute(state.tokens)
            return trees, None
        if root + Tree.of(trees[0].parents).depth >= switch:
            return [DraftTree.empty(trees[0].tokens.device)], switch
        return trees, switch

    def _cut(self, block: list[int], room: int) -> tuple[list[int], bool]:
        """A round's accepted tokens and next token, up to the first EOS or the sequence's last
        allowed token (`room` left): both may land inside the accepted path. Returns (the
        tokens committed, whether the sequence is done)."""
        for j, tok in enumerate(block):
            if tok in self.eos or j + 1 >= room:
                return block[: j + 1], True
        return block, False

    def _sample(self, logits: Tensor, generator) -> int:
        if self.policy.greedy or self.typical is not None:  # typical: "first token greedy"
            return int(argmax(logits))
        return int(self.policy.sample(self.policy.probs(logits.float()), generator))

    def _verify(
        self, states: Sequence[DecodeState], trees: Sequence[DraftTree], generator
    ) -> list[tuple[list[int], int, Tensor]]:
        """Score every sequence's root + tree in one target forward, accept a path in each, keep
        only the paths' KV.

        Returns:
            per sequence (path, next_token, features): the accepted node indices from the root,
            the token emitted after them, and the target features of the path's nodes
            (1, len(path), H).
        """
        device = next(self.target.parameters()).device
        n = 1 + max(tree.size for tree in trees)
        rows = []
        for state, tree in zip(
            states, trees
        ):  # each row: its root, its tree, padded with its root to n
            root = torch.tensor([state.tokens[-1]], device=device)
            rows.append(torch.cat([root, tree.tokens.to(device), root.expand(n - 1 - tree.size)]))
        x = torch.stack(rows)  # (B, n)
        out = self.runner.verify(x, [tree.parents for tree in trees])
        results = []
        for b, tree in enumerate(trees):
            size = tree.size + 1
            path, next_token = self._accept(tree, x[b, :size], out.logits[b, :size], generator)
            results.append((path, int(next_token), out.features[b : b + 1, path]))
        self.runner.commit([path for path, _, _ in results])
        return results

    def _accept(
        self, tree: DraftTree, tokens: Tensor, logits: Tensor, generator
    ) -> tuple[list[int], int]:
        """The accepted path and the next token of one sequence's verified tree: tokens (n,) the
        root and the tree, logits (n, V) the target's at each of them."""
        parents = list(tree.parents)
        if self.policy.greedy:  # typical acceptance included: with a one-hot p it is greedy
            return verify_tree_greedy(parents, tokens, logits)
        if self.typical is not None:
            p = self.policy.probs(logits.float())  # (n, V) temperature-scaled p at every node
            return verify_tree_typical(parents, tokens, p, self.typical.eps, self.typical.delta)
        p = RowProbs(
            self.policy, logits.float()
        )  # (n, V), each row computed when the verifier reads it
        if tree.size == 0:
            q_full = logits.new_zeros(
                logits.shape, dtype=torch.float32
            )  # (1, V): the root's row is never read
        elif tree.q is None:
            raise ValueError(f"{self.proposer.name} gave no proposal distributions under sampling")
        else:
            q = tree.q.to(device=logits.device, dtype=torch.float32)
            q_full = torch.cat([q.new_zeros(1, q.shape[-1]), q])  # (n, V)
        return verify_tree_stochastic(parents, tokens, p, q_full, generator, repeats=tree.repeats)


def check_fits(
    prompt_len: int,
    max_new_tokens: int,
    tree_size: int,
    context: int | None,
    model: str = "the target",
) -> None:
    """Raise before decoding when a request cannot be served: an empty prompt, no new tokens, or
    prompt + new tokens + the verified tree (root included) past the `context` of `model`."""
    if prompt_len == 0:
        raise ValueError("empty prompt: give at least one token")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    need = prompt_len + max_new_tokens + tree_size + 1
    if context is not None and need > context:
        room = f"tree ({tree_size + 1})" if tree_size else "1"
        raise ContextOverflowError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + {room} = {need} "
            f"tokens exceed {model}'s context of {context}"
        )


def check_longrope(
    prompt_lens: Sequence[int], budgets: Sequence[int], tree_size: int, switch: int | None
) -> None:
    """Raise `ContextOverflowError` for a batch that would cross a longrope target's `switch`
    (`eagle.target.longrope_switch`) while decoding. Below it every forward rotates with the short
    factors, and from a prefill past it all of them with the long ones. One sequence crosses it as
    Hugging Face's `generate` does (`SpeculativeDecoder._at_switch`: the whole cache recomputed,
    rotated long); in a batch the longest position of all rows decides how every row is rotated,
    so the rows must stay on one side of it."""
    if switch is None or len(prompt_lens) == 1:
        return
    short = [
        n + b + tree_size + 1 <= switch for n, b in zip(prompt_lens, budgets)
    ]  # every position below it
    long = [n > switch for n in prompt_lens]  # the prefill already past it
    if all(short) or all(long):
        return
    bad = next((i for i, (s, lo) in enumerate(zip(short, long)) if not (s or lo)), None)
    where = (
        f"prompt {bad} ({prompt_lens[bad]} tokens + {budgets[bad]} new + the tree's "
        f"{tree_size + 1}) crosses it"
        if bad is not None
        else "the batch mixes prompts below and past it"
    )
    raise ContextOverflowError(
        f"this target's longrope rotary switches to its long factors at {switch} positions and "
        f"in this batch {where}: the batch's longest row would rotate every row's positions. "
        f"Keep each row's prompt + new tokens + tree within {switch}, or start every row past it "
        f"(prompts of more than {switch} tokens), or decode such a row alone"
    )


def check_tree(tree: DraftTree, vocab_size: int, proposer: str) -> None:
    """Raise ValueError when a draft tree does not fit the target's vocabulary of `vocab_size`
    (a draft model of another vocabulary): checked on a sequence's first round, where it would
    otherwise end in an index error deep in the verification."""
    if tree.size and not 0 <= int(tree.tokens.min()) <= int(tree.tokens.max()) < vocab_size:
        raise ValueError(
            f"{proposer} drafted token ids outside the target's vocabulary of {vocab_size}: "
            "is the draft model made for another tokenizer?"
        )
    if tree.q is not None and tree.q.shape[-1] != vocab_size:
        raise ValueError(
            f"{proposer} gave proposal distributions over {tree.q.shape[-1]} tokens, the target "
            "has "
            f"{vocab_size}: is the draft model made for another tokenizer?"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

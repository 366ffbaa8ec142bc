"""Which dtype and which linear kernels verify faster on this machine: measured on the target,
not assumed.

A CPU with bf16 instructions does not make bf16 the faster choice for every model. With
AMX, bf16 verified EAGLE's trees faster than fp32 (LOG.md); on an AVX512-BF16 CPU without
AMX, a small target verified and decoded slower in bf16 than in fp32 (LOG.md, 2026-12-01). At
that size per-op overhead and the dtype conversions around each kernel outweigh the faster
arithmetic; at 7B the
halved weight traffic likely wins. So where the machine could go either way (a wide
method on a CPU with bf16 instructions), `faster_dtype` times the target's own verification
forward in each dtype and the faster one is used.

The forward timed is the one a round makes: `width` new tokens (the tree and its root) on
top of `prefix` cached ones, the cache cropped back after each; the dtypes take turns, so
load on a shared machine falls on both alike, and the median of `reps` is compared. float32
is kept unless bf16 is faster by a margin (5%): a bf16 verification rounds near-ties
differently, so its greedy texts are not float32 vanilla's, and a near-tie in the timing
would otherwise flip the choice from run to run.

The same holds for the kernels of the linears (`eagle.kernels`): oneDNN's packed products
or our fused kernels beat `F.linear` by far on some CPUs, and the fused kernels' software
prefetch helps on some CPUs and slows others (measured: docs/performance.md). `faster_kernels`
times, with each kernel setting in turn on the target itself (switched in place), what a
decoding round costs the target: its runner's verification and commit, in the runner's decoding
scope, of one token (a plain step) and of a tree (the root and 25 draft nodes, EAGLE-1's
width). A setting runs every method alike, vanilla decoding included, and vanilla's step is the
baseline of every speedup: so the step decides (`pick_kernels`), and the tree's verification
only breaks a tie between steps within the margin. A setting that verified trees faster but
stepped slower once won on the sum of the two and made plain decoding slower, moving every
speedup of the table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from eagle.decoding.kv_cache import crop, new_cache
from eagle.decoding.runners import DynamicRunner
from eagle.kernels import KERNELS, use_kernels
from eagle.target import target_forward
from eagle.tree import TreeTemplate


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # the faster one, or the preferred one where it is within the margin
    width: int  # tokens per timed verification forward
    ms: dict[str, float]  # median ms of one verification forward, per dtype
    kept: bool = False  # the preferred dtype, kept although another was (slightly) faster

    def describe(self) -> str:
        times = ", ".join(f"{name} {ms:.2f} ms" for name, ms in self.ms.items())
        kept = "; kept, within the margin of the fastest" if self.kept else ""
        return f"{self.dtype} (verifying {self.width} tokens, measured here: {times}{kept})"


def _forward_ms(
    model: nn.Module, tokens: torch.Tensor, cache, prefix: int, clock: Callable[[], float]
) -> float:
    """Milliseconds of one forward of `tokens` on top of `cache`'s `prefix` tokens (a GPU's
    kernels waited for), after which the cache is cropped back to `prefix`."""
    device = tokens.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    target_forward(model, tokens, cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = 1000 * (clock() - t0)
    crop(cache, prefix)
    return ms


@torch.inference_mode()
def faster_dtype(
    models: Mapping[str, nn.Module],
    width: int,
    prefix: int = 128,
    reps: int = 10,
    warmup: int = 3,
    seed: int = 0,
    prefer: str | None = "float32",
    margin: float = 0.05,
    clock: Callable[[], float] = time.perf_counter,
) -> DtypeChoice:
    """Time one verification forward of `width` tokens after `prefix` cached ones for each of
    `models` (dtype name -> the same target in that dtype); return the faster dtype.

    Args:
        models: at least one model; all must share a vocabulary and fit prefix + width tokens.
        reps, warmup: timed and untimed forwards per dtype, interleaved across dtypes.
        prefer, margin: the dtype kept unless another is faster by more than `margin` (a
            fraction of the preferred one's time).
        clock: seconds, read before and after each timed forward (tests pass a fake one).
    """
    if not models:
        raise ValueError("faster_dtype needs at least one model")
    if width < 1 or prefix < 1:
        raise ValueError(f"width and prefix must be >= 1, got {width} and {prefix}")
    g = torch.Generator().manual_seed(seed)
    vocab = min(int(m.config.vocab_size) for m in models.values())
    ids = torch.randint(0, vocab, (1, prefix + width), generator=g)
    devices = {name: next(model.parameters()).device for name, model in models.items()}
    tokens = {
        name: ids[:, prefix:].to(device) for name, device in devices.items()
    }  # the timed forward's
    caches = {name: new_cache(prefix + width) for name in models}
    for name, model in models.items():
        target_forward(
            model, ids[:, :prefix].to(devices[name]), caches[name], logits_slice=slice(-1, None)
        )
    times: dict[str, list[float]] = {name: [] for name in models}
    for rep in range(warmup + reps):
        for name, model in models.items():
            ms = _forward_ms(model, tokens[name], caches[name], prefix, clock)
            if rep >= warmup:
                times[name].append(ms)
    ms = {name: statistics.median(t) for name, t in times.items()}
    dtype = preferred(ms, prefer, margin)
    return DtypeChoice(dtype=dtype, width=width, ms=ms, kept=dtype != min(ms, key=ms.get))


def preferred(ms: Mapping[str, float], prefer: str | None = "float32", margin: float = 0.05) -> str:
    """The key of `ms` (a cost per choice) to use: the cheapest, unless `prefer` is among them and
    the cheapest saves no more than `margin` of its cost. A near-tie then keeps the preferred dtype
    (float32: its greedy texts are vanilla's) instead of flipping with the machine's drift."""
    if not ms:
        raise ValueError("preferred needs at least one measured cost")
    fastest = min(ms, key=ms.get)
    if prefer in ms and fastest != prefer and ms[fastest] >= (1 - margin) * ms[prefer]:
        return prefer
    return fastest


# the tree a round verifies while the kernels are timed: the root and 25 draft nodes, the width
# of EAGLE-1's default tree (its shape changes only the mask)
PROBE_TREE = tuple(TreeTemplate.static_expansion((5, 4)).parents)


@dataclass(frozen=True)
class KernelChoice:
    kernels: str  # the setting chosen (eagle.kernels.KERNELS)
    ms: dict[str, dict[int, float]]  # setting -> tokens a round verifies -> median ms of a round
    why: str = ""  # which figure decided (`pick_kernels`)
    rounds: int = 0  # timed rounds behind each median

    def describe(self) -> str:
        times = "; ".join(
            f"{name} " + ", ".join(f"{_tokens(n)} {ms:.2f} ms" for n, ms in by.items())
            for name, by in self.ms.items()
        )
        count = f"median of {self.rounds} rounds each, " if self.rounds else ""
        return f"{self.kernels}, {self.why} ({count}measured here: {times})"


def _tokens(n: int) -> str:
    return "a step" if n == 1 else f"{n} tokens"


def pick_kernels(ms: Mapping[str, Mapping[int, float]], margin: float = 0.05) -> tuple[str, str]:
    """The setting to decode with, and why, from each setting's median ms of a round by tokens
    it verifies (1: a plain step; more: a tree), the settings in order plainest first.

    The fastest step wins. Settings whose steps are within `margin` of the fastest tie, and
    their tree verifications decide: the fastest, unless a plainer one is within `margin` of
    it (the settings round differently, so a near-tie keeps the plainer instead of flipping
    with the machine's drift). Without a tree's figures, a tie keeps the plainest."""
    if not ms or any(1 not in by for by in ms.values()):
        raise ValueError(f"pick_kernels needs each setting's 1-token step, got {dict(ms)}")
    steps = {name: by[1] for name, by in ms.items()}
    fastest = min(steps.values())
    tied = [name for name, step in steps.items() if step <= fastest * (1 + margin)]
    if len(tied) == 1:
        return tied[0], "the fastest step"
    tie = f"steps within {margin:.0%} of the fastest: {', '.join(tied)}"
    trees = {name: [v for n, v in ms[name].items() if n != 1] for name in tied}
    if not all(trees.values()):
        return tied[0], f"{tie}; the plainest"
    cost = {name: sum(v) for name, v in trees.items()}
    quickest = min(cost.values())
    best = next(name for name in tied if cost[name] <= quickest * (1 + margin))
    if cost[best] == quickest:
        return best, f"{tie}; the fastest tree verification"
    return best, f"{tie}; the plainest tree verification within {margin:.0%} of the fastest"


@torch.inference_mode()
def faster_kernels(
    model: nn.Module,
    kernels: tuple[str, ...] = KERNELS,
    tree: tuple[int, ...] = PROBE_TREE,
    prefix: int = 128,
    rounds: int = 3,
    turns: int = 3,
    seed: int = 0,
    margin: float = 0.05,
    clock: Callable[[], float] = time.perf_counter,
) -> KernelChoice:
    """Time decoding rounds of `model` with each of `kernels` and leave it on the one
    `pick_kernels` chooses; `tree`: the parents of the tree a round verifies.

    Each setting decodes through its own `DynamicRunner` (the engine's default), after a
    prompt of `prefix` random tokens, inside the runner's decoding scope, as the engine
    decodes. A round is the runner's verification of the root (a step) or of the root and
    `tree`, and the commit of the root: what a round costs the target, read by `clock`
    (seconds; tests pass a fake one) around the two. The settings take turns, `turns` times,
    so that load on a shared machine falls on all alike; in each turn a setting is switched
    on (`use_kernels`; the packed weights stay between turns: packing is not timed), runs one
    untimed step and one untimed tree (what a switch leaves to do: a fused backbone installed
    anew checks every layer's weights at its first forward; and each shape's first call), then
    `rounds` timed steps and `rounds` timed trees. Each figure is the median of its
    turns x rounds."""
    if not kernels or rounds < 1 or turns < 1 or prefix < 1:
        raise ValueError(
            f"faster_kernels needs kernels, rounds, turns and prefix >= 1, got "
            f"{kernels}, {rounds}, {turns}, {prefix}"
        )
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    prompt = torch.randint(0, vocab, (1, prefix), generator=g).to(device)
    width = len(tree)
    drafts = torch.randint(0, vocab, (1, width), generator=g).to(device)  # the root and the tree
    max_len = prefix + turns * 2 * (rounds + 1) + width + 1
    runners: dict[str, DynamicRunner] = {}
    times: dict[str, dict[int, list[float]]] = {k: {1: [], width: []} for k in kernels}

    def round_ms(runner: DynamicRunner, n: int) -> float:
        t0 = clock()
        runner.verify(drafts[:, :n], [tree[:n]])
        runner.commit([[0]])  # the root: each round commits one token, as a step does
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 1000 * (clock() - t0)

    for _ in range(turns):
        for name in kernels:
            use_kernels(model, name, release=False)
            if name not in runners:
                runners[name] = DynamicRunner(model)
                runners[name].prefill(prompt, max_len)
            runner = runners[name]
            with runner.decoding():
                for n in (1, width):
                    round_ms(runner, n)  # untimed: what the switch left to do, the shape's first
                for n in (1, width):
                    times[name][n] += [round_ms(runner, n) for _ in range(rounds)]
    ms = {name: {n: statistics.median(t) for n, t in by.items()} for name, by in times.items()}
    best, why = pick_kernels(ms, margin)
    use_kernels(model, best)  # the others' packed weights are freed
    return KernelChoice(kernels=best, ms=ms, why=why, rounds=turns * rounds)

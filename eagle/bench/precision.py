"""Which dtype and which linear kernels verify faster on this machine: measured on the target,
not assumed.

A CPU with bf16 instructions does not make bf16 the faster choice for every model. With
AMX, bf16 verified EAGLE's trees faster than fp32 (LOG.md); on an AVX512-BF16 CPU without
AMX, the 12 x 96 CPU target verified 26 tokens in 7.4 ms in bf16 against 6.4 ms in fp32, and
decoded one token in 6.0 ms against 3.4 ms (LOG.md, issue 17). At that size per-op overhead
and the dtype conversions around each kernel outweigh the faster arithmetic; at 7B the
halved weight traffic likely wins. So where the machine could go either way (a wide
method on a CPU with bf16 instructions), `faster_dtype` times the target's own verification
forward in each dtype and the faster one is used.

The forward timed is the one a round makes: `width` new tokens (the tree and its root) on
top of `prefix` cached ones, the cache cropped back after each; the dtypes take turns, so
load on a shared machine falls on both alike, and the median of `reps` is compared. float32
is kept unless bf16 is faster by a margin (5%): a bf16 verification rounds near-ties
differently, so its greedy texts are not float32 vanilla's, and a near-tie in the timing (one
measured 50.5 against 51.9 ms, LOG.md) would otherwise flip the choice from run to run.

The same holds for the kernels of the linears (`eagle.kernels.backends`): oneDNN's packed
products took SmolLM2's float32 step from ~69 to ~55 ms on an AVX512 AMD EPYC, where MKL's
few-row products run far below the memory's speed, but another CPU's MKL may be the faster one.
`faster_kernels` times a 1-token step and a tree's verification with each kernel setting on the
target itself (switched in place) and leaves it on the faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from eagle.decoding.kv_cache import crop, new_cache
from eagle.kernels.backends import KERNELS, use_kernels
from eagle.target import target_forward


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


def _forward_ms(model: nn.Module, tokens: torch.Tensor, cache, prefix: int, clock: Callable[[], float]) -> float:
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
def faster_dtype(models: Mapping[str, nn.Module], width: int, prefix: int = 128, reps: int = 10,
                 warmup: int = 3, seed: int = 0, prefer: str | None = "float32", margin: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter) -> DtypeChoice:
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
    tokens = {name: ids[:, prefix:].to(device) for name, device in devices.items()}  # the timed forward's
    caches = {name: new_cache(prefix + width) for name in models}
    for name, model in models.items():
        target_forward(model, ids[:, :prefix].to(devices[name]), caches[name], logits_slice=slice(-1, None))
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


@dataclass(frozen=True)
class KernelChoice:
    kernels: str  # the faster setting (eagle.kernels.backends.KERNELS)
    ms: dict[str, dict[int, float]]  # kernels -> tokens per forward -> median ms

    def describe(self) -> str:
        times = "; ".join(f"{name} " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in by_width.items())
                          for name, by_width in self.ms.items())
        return f"{self.kernels} (measured here: {times})"


@torch.inference_mode()
def faster_kernels(model: nn.Module, widths: tuple[int, ...] = (1, 26), prefix: int = 128, reps: int = 5,
                   warmup: int = 2, seed: int = 0, kernels: tuple[str, ...] = KERNELS,
                   clock: Callable[[], float] = time.perf_counter, margin: float = 0.05) -> KernelChoice:
    """Time forwards of each of `widths` new tokens after `prefix` cached ones with each kernel
    setting on `model` (a 1-token step and a tree's verification, by default), and leave `model`
    on the setting whose medians sum to the least, unless one earlier in `kernels` (the plainer:
    `default`, then `onednn`, then `fused`, then `fused_prefetch`) is within `margin` of it: a
    near-tie in 5 repeats would flip from run to run, and the settings round differently. The
    settings take turns by repeat, as the dtypes do in `faster_dtype`, each switch followed by one
    untimed forward (a switch to the fused kernels from another setting installs their backbone
    anew, whose first forward checks every layer's weights: ~1 ms that a switch between the two
    fused settings does not pay)."""
    if not kernels or any(w < 1 for w in widths) or prefix < 1:
        raise ValueError(f"faster_kernels needs kernels, widths >= 1 and prefix >= 1, got {kernels}, {widths}, {prefix}")
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(model.config.vocab_size), (1, prefix + max(widths)), generator=g).to(device)
    cache = new_cache(prefix + max(widths))
    target_forward(model, ids[:, :prefix], cache, logits_slice=slice(-1, None))
    times: dict[str, dict[int, list[float]]] = {k: {w: [] for w in widths} for k in kernels}
    for rep in range(warmup + reps):
        for name in kernels:
            use_kernels(model, name, release=False)  # packed weights stay between turns: packing is not timed
            target_forward(model, ids[:, prefix:prefix + 1], cache)  # untimed: what a switch leaves to do
            crop(cache, prefix)
            for width in widths:
                ms = _forward_ms(model, ids[:, prefix:prefix + width], cache, prefix, clock)
                if rep >= warmup:
                    times[name][width].append(ms)
    ms = {name: {w: statistics.median(t) for w, t in by_width.items()} for name, by_width in times.items()}
    total = {name: sum(by_width.values()) for name, by_width in ms.items()}
    fastest = min(total.values())
    best = next(name for name in kernels if total[name] <= fastest * (1 + margin))
    use_kernels(model, best)  # on default, the packed weights are freed
    return KernelChoice(kernels=best, ms=ms)

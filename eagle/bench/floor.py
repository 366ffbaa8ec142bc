"""The memory floor of a decoding step, and how far the target's forwards are from it.

A decoding step reads every weight of the target once; whatever its kernels do, it cannot take
less than (bytes of the weights) / (memory bandwidth). A forward of n new tokens reads the same
bytes, so while the arithmetic stays small next to them (n x 2 x parameters FLOP), verifying a
tree of n tokens should cost about one step. This module measures both sides on this machine:

  bandwidth      `read_bandwidth`: the best of a few streaming reads (a sum) of a buffer several
                 times larger than any cache, with the threads the decoding uses, in 2 MB pages
                 where the fused kernels' weights are (`eagle.kernels.fused`: a read of 4 KB
                 pages is slower (LOG.md), and the floor is the fastest read of the memory);
  floor          the target's weight bytes / that bandwidth (`weight_bytes`);
  roof           a forward of n tokens also does n x 2 x (linear weights) FLOP (`linear_flops`), at
                 most at the machine's peak rate (`peak_gflops`: a large square product), so it
                 cannot beat max(floor, n x FLOP per token / peak): on 2 CPU cores the arithmetic
                 of ~20 tokens of a 135M target already outweighs reading its weights, and a wide
                 tree's verification is bound by arithmetic, not memory;
  products       `product_costs`: each product a step runs (by weight shape; siblings that share
                 one packed product count as one) of a few rows under each linear kernel, in ms
                 and GB/s (which kernel reads the weights at the memory's speed);
  forward costs  `settings_costs`: the target's verification of n = 1, 2, 4, ... new tokens after a
                 fixed context, through the engine's own runners (a tree of n nodes, so the tree
                 mask is paid as in a round) under each setting (runner and kernels), the
                 settings and sizes taking turns, each the median of a few repeats, in
                 milliseconds and in units of the floor and of the 1-token step;
  paired floors  with a `BandwidthProbe`, a streaming read just before each timed forward: each
                 forward is divided by the floor of its own moment, and the median of those
                 ratios is reported beside the ratio to the one probe at the start. On a shared
                 VM the bandwidth moves between minutes (the EPYC's memory has two speeds:
                 docs/results.md), so a step and a floor measured minutes apart can say 1.1 or
                 2.4 floors of the same kernels; the paired ratio does not depend on when the
                 probe ran. The probe also empties the caches, so every paired forward reads
                 its weights from memory, as the floor assumes.

`decode.py mode=floor` runs it and writes floor.json and floor.md (and the same figures for each
linear-kernel setting it is asked to compare: `eagle.kernels`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from eagle.bench.precision import KernelChoice
from eagle.decoding.backend import kernels_of
from eagle.decoding.runners import TargetRunner, make_runner
from eagle.kernels import KERNELS, available_kernels, check_kernels, fused, use_kernels
from eagle.kernels.onednn import PackedLinear

FORWARD_TOKENS = (1, 2, 4, 8, 16, 26, 64)  # 26: EAGLE-1's default tree with its root
NOTHING_TO_TIME = "nothing to time: no packed products for this device or dtype, or no room"


def weight_bytes(model: nn.Module) -> int:
    """Bytes one decoding step reads: every parameter once (`parameters()` yields a tied
    embedding and LM head once), but of an untied input embedding table only the row of the
    token (the rest of it is never read; tied, it is the LM head, read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != table.data_ptr():
        total -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    return total


def linear_flops(model: nn.Module) -> int:
    """FLOP of one token through the model's linears (2 per weight: a multiply and an add), the
    LM head included; attention over the context and the elementwise operations are left out."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def _best_seconds(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None], warm: bool = True
) -> float:
    if warm:
        fn()  # first touch: page faults and lazy initialisation are not bandwidth
        sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


class BandwidthProbe:
    """Streaming read bandwidth in GB/s, on call: the fastest of `repeats` sums of a float32
    buffer of `megabytes` (far beyond the caches, so every byte comes from memory), with torch's
    current threads. A sum does one addition per 4 bytes read: it is bound by memory, not
    arithmetic. The buffer is allocated and touched once, so a probe between two forwards costs
    only its reads (~0.1 s for 3 x 1 GB)."""

    def __init__(self, device: str | torch.device = "cpu", megabytes: int = 1024, repeats: int = 3):
        self.device, self.repeats = torch.device(device), repeats
        # random values, not a constant: a host that merges identical pages (KSM) would serve a
        # buffer of ones from a few physical pages, out of the caches
        numel = megabytes * 2**20 // 4
        if self.device.type == "cpu" and fused.available():  # 2 MB pages, as the packed weights'
            self.buffer = fused.load().huge_zeros([numel]).uniform_()
        else:
            self.buffer = torch.rand(numel, dtype=torch.float32, device=self.device)
        self.buffer.sum()  # first touch: page faults and lazy initialisation are not bandwidth
        _sync(self.device)()

    def __call__(self, repeats: int | None = None) -> float:
        seconds = _best_seconds(
            lambda: self.buffer.sum(), repeats or self.repeats, _sync(self.device), warm=False
        )
        return self.buffer.numel() * 4 / seconds / 1e9


def read_bandwidth(
    device: str | torch.device = "cpu", megabytes: int = 1024, repeats: int = 5
) -> float:
    """One `BandwidthProbe` reading: the fastest of `repeats` streaming reads of `megabytes`."""
    return BandwidthProbe(device, megabytes)(repeats)


@torch.inference_mode()
def peak_gflops(
    device: str | torch.device = "cpu",
    size: int = 1024,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
) -> float:
    """GFLOP/s of the fastest of `repeats` products of `size` rows through a `size` x `size`
    linear in `dtype`, with torch's current threads, under each linear kernel this device has
    (`eagle.kernels`; on a 2-core AVX-512 EPYC oneDNN's reached 185 GFLOP/s where
    `F.linear` reached 133): bound by arithmetic (2 size^3 FLOP on 3 size^2 numbers), the best
    rate the linears can reach here."""
    device = torch.device(device)
    linear = nn.Linear(size, size, bias=False, device=device, dtype=dtype).requires_grad_(False)
    x = torch.randn(size, size, device=device).to(dtype)
    seconds = min(
        _best_seconds(lambda k=kernels: use_kernels(linear, k)(x), repeats, _sync(device))
        for kernels in available_kernels(device)
    )
    return 2 * size**3 / seconds / 1e9


def binary_tree(n: int) -> tuple[int, ...]:
    """Parents of an n-node tree whose node i hangs under node (i - 1) // 2: a tree (not a chain)
    from n = 3 on, so the runner builds a tree mask as it does in a round."""
    return tuple((i - 1) // 2 for i in range(n))


RunnerFactory = Callable[[int], TargetRunner]  # tokens per forward -> a fresh runner for that width


def runner_factory(
    target: nn.Module, kind: str = "dynamic", compile_mode: str | None = None, max_len: int = 512
) -> RunnerFactory:
    """Runners of the engine for `forward_costs`: a static one is sized for exactly n tokens per
    forward (its fixed width, one compiled graph per n) with `max_len` slots."""
    if kind == "dynamic":
        return lambda n: make_runner("dynamic", target)
    return lambda n: make_runner(
        "static", target, tree_size=n - 1, max_len=max_len, compile_mode=compile_mode
    )


@dataclass
class ForwardCost:
    """One size's forwards: the median time, and with a probe, each forward against the floor of
    its own moment."""

    ms: float  # median of the timed forwards
    times_ms: list[float] = field(default_factory=list)  # each timed forward
    bandwidth_gb_s: list[float] = field(
        default_factory=list
    )  # the probe just before each ([] without one)
    paired_floors: float | None = None  # median of forward / (weight bytes / that bandwidth)


@torch.inference_mode()
def forward_costs(
    target: nn.Module,
    tokens: Sequence[int] = FORWARD_TOKENS,
    context: int = 200,
    repeats: int = 5,
    make: RunnerFactory | None = None,
    seed: int = 0,
    batch: int = 1,
    probe: Callable[[], float] | None = None,
) -> dict[int, ForwardCost]:
    """The target's verification of n new tokens on top of `context` committed ones, for each n
    in `tokens`, through a runner of the engine from `make` (by default the dynamic one): one
    setting of `settings_costs`, which says how the forwards are timed."""
    settings = {"": Setting(make or runner_factory(target))}
    return settings_costs(target, settings, tokens, context, repeats, seed, batch, probe)[""]


@dataclass
class Setting:
    """A way of running the target's forwards: its runners, and what puts the target on this
    setting's kernels before each of its turns (None: nothing to switch)."""

    make: RunnerFactory
    activate: Callable[[], object] | None = None


@torch.inference_mode()
def settings_costs(
    target: nn.Module,
    settings: Mapping[str, Setting],
    tokens: Sequence[int] = FORWARD_TOKENS,
    context: int = 200,
    repeats: int = 5,
    seed: int = 0,
    batch: int = 1,
    probe: Callable[[], float] | None = None,
) -> dict[str, dict[int, ForwardCost]]:
    """For each setting and each n in `tokens`: `repeats` timed forwards of n new tokens after
    `context` committed ones, after one untimed warm-up (which compiles, on a compiled runner),
    and their median in ms. The settings and sizes take turns, one forward of each per repeat,
    so that a change of the machine's speed during the run (a shared VM's memory bandwidth moves
    between minutes) falls on every setting and size alike, and their ratios (n tokens in 1-token
    steps, one setting against another) hold. Each forward commits its root only, so each
    runner's context grows by one token per forward, as in decoding. With `batch` B, each
    forward verifies n tokens for each of B sequences (B x n tokens), as a batched round does.
    With a `probe` (GB/s, e.g. a `BandwidthProbe`), a streaming read runs just before each
    timed forward and the forward is also counted in floors of that moment
    (`ForwardCost.paired_floors`)."""
    device = next(target.parameters()).device
    sync = _sync(device)
    nbytes = weight_bytes(target)
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    ids = torch.randint(3, vocab, (batch, context), generator=g).to(device)
    drafts = {n: torch.randint(3, vocab, (batch, n), generator=g).to(device) for n in tokens}
    parents = {n: [binary_tree(n)] * batch for n in tokens}
    runners = {}  # (setting, n) -> its runner, prefilled
    for name, setting in settings.items():
        if setting.activate is not None:
            setting.activate()
        for n in tokens:
            runners[name, n] = setting.make(n)
            runners[name, n].prefill(ids, context + repeats + n + 1)
    times: dict[tuple, list[float]] = {key: [] for key in runners}
    bandwidths: dict[tuple, list[float]] = {key: [] for key in runners}

    def forward(key: tuple) -> float:
        kept, n = runners[key], key[1]
        with kept.decoding():  # as the engine decodes: the weights' check comes before, untimed
            sync()
            start = time.perf_counter()
            kept.verify(drafts[n], parents[n])
            sync()
            ms = (time.perf_counter() - start) * 1e3
        kept.commit([[0]] * batch)
        return ms

    for turn in range(
        repeats + 1
    ):  # turn 0: the first forward of each shape warms up (or compiles) its kernels
        for name, setting in settings.items():
            if setting.activate is not None:
                setting.activate()
            for n in tokens:
                if turn and probe is not None:
                    bandwidths[name, n].append(probe())
                ms = forward((name, n))
                if turn:
                    times[name, n].append(ms)
    costs: dict[str, dict[int, ForwardCost]] = {name: {} for name in settings}
    for (name, n), measured in times.items():
        pairs = zip(measured, bandwidths[name, n])
        paired = (
            statistics.median(ms * gb_s * 1e6 / nbytes for ms, gb_s in pairs)
            if bandwidths[name, n]
            else None
        )
        costs[name][n] = ForwardCost(
            statistics.median(measured), measured, bandwidths[name, n], paired
        )
    return costs


def roof_ms(tokens: int, floor_ms: float, flops_per_token: int, gflops: float | None) -> float:
    """The least a forward of `tokens` new tokens can cost: reading the weights once, or doing
    its linears' arithmetic at the peak rate, whichever takes longer (the floor without a rate)."""
    return max(floor_ms, tokens * flops_per_token / (gflops * 1e9) * 1e3) if gflops else floor_ms


def floor_report(
    target: nn.Module,
    bandwidth_gb_s: float,
    costs: Mapping[int, ForwardCost],
    step: float | None = None,
    batch: int = 1,
    gflops: float | None = None,
) -> dict:
    """The figures of one setting: weight bytes, the floor, and each forward in ms, in floors (of
    the probe `bandwidth_gb_s`, and paired: of the probe before each forward, when there was one),
    in roofs (`roof_ms` at the peak rate `gflops`, when measured) and in 1-token steps (`step`: of
    one sequence, for a batch's forwards; default: its own 1-token)."""
    nbytes, flops = weight_bytes(target), linear_flops(target)
    floor_ms = nbytes / (bandwidth_gb_s * 1e9) * 1e3
    step = step if step is not None else (costs[1].ms if 1 in costs else None)
    rows = []
    for n, cost in costs.items():
        ms, roof = cost.ms, roof_ms(n * batch, floor_ms, flops, gflops)
        rows.append(
            {
                "tokens": n,
                "ms": ms,
                "floors": ms / floor_ms,
                "roof_ms": roof,
                "roofs": ms / roof,
                "steps": ms / step if step else None,
                "paired_floors": cost.paired_floors,
                "times_ms": cost.times_ms,
                "probe_gb_s": cost.bandwidth_gb_s,
            }
        )
    return {
        "weight_bytes": nbytes,
        "bandwidth_gb_s": bandwidth_gb_s,
        "floor_ms": floor_ms,
        "batch": batch,
        "flops_per_token": flops,
        "peak_gflops": gflops,
        "forwards": rows,
    }


def step_products(model: nn.Module) -> dict[tuple[int, int], list[nn.Linear]]:
    """The products a step of `model` runs on its current kernels, by weight shape (out x in):
    each linear's own, or one per group of siblings sharing a packed product
    (`eagle.kernels.onednn.SiblingGroup`: their stacked shape, run through any member)."""
    shapes: dict[tuple[int, int], list[nn.Linear]] = {}
    groups = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        group = module._siblings if isinstance(module, PackedLinear) else None
        if group is None:
            shapes.setdefault(tuple(module.weight.shape), []).append(module)
        elif (
            id(group) not in groups
        ):  # a member called again on the same input computes the whole product
            groups.add(id(group))
            shapes.setdefault((sum(group.sizes), module.in_features), []).append(module)
    return shapes


@torch.inference_mode()
def product_costs(
    model: nn.Module,
    rows: Sequence[int] = (1, 2, 8, 26),
    repeats: int = 3,
    kernels: Sequence[str] | None = None,
) -> list[dict]:
    """Milliseconds of one product of n rows through each weight shape a step reads (out x in,
    `step_products`), with each kernel setting (`eagle.kernels`; default: every one this
    device has): the model's own products of that shape one after another, as a step reads them
    (so mostly from memory), the best of `repeats` such passes divided by their number. The
    model is left on the kernels it had."""
    device = next(model.parameters()).device
    before = kernels_of(model)
    costs = []
    for setting in kernels or available_kernels(device):
        use_kernels(model, setting, release=False)
        for (out, width), linears in step_products(model).items():
            weight = linears[0].weight
            for n in rows:
                x = torch.randn(n, width, device=device).to(weight.dtype)
                ms = (
                    _best_seconds(
                        lambda ls=linears, x=x: [m(x) for m in ls], repeats, _sync(device)
                    )
                    / len(linears)
                    * 1e3
                )
                costs.append(
                    {
                        "kernels": setting,
                        "shape": [out, width],
                        "products": len(linears),
                        "rows": n,
                        "ms": ms,
                        "gb_s": out * width * weight.element_size() / ms / 1e6,
                    }
                )
    use_kernels(model, before)
    return costs


def products_markdown(costs: list[dict]) -> str:
    """One row per (shape, products a step, rows), one column per kernel setting: ms (GB/s of the
    weight read); "-" where a setting runs no product of that shape (siblings share theirs)."""
    settings = list(dict.fromkeys(c["kernels"] for c in costs))
    cells: dict[tuple, dict[str, dict]] = {}
    for c in costs:
        cells.setdefault((tuple(c["shape"]), c["products"], c["rows"]), {})[c["kernels"]] = c
    lines = [
        "| weight (out x in) | products a step | rows | "
        + " | ".join(f"{k}: ms (GB/s)" for k in settings)
        + " |",
        "|---|---:|---:|" + "---:|" * len(settings),
    ]
    for (shape, count, n), by in cells.items():
        lines.append(
            f"| {shape[0]} x {shape[1]} | {count} | {n} | "
            + " | ".join(
                f"{by[k]['ms']:.3f} ({by[k]['gb_s']:.1f})" if k in by else "-" for k in settings
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def parse_settings(
    settings: Sequence[str], device: str | torch.device = "cpu"
) -> dict[str, tuple[str, bool, str]]:
    """`floor.settings` as {setting: (runner, compiled, kernels)}: each is
    RUNNER[+compile][+KERNELS|+auto] with RUNNER dynamic or static, compile for the static runner
    only, at most one kernel setting (checked for `device`; auto is left for the caller to choose:
    `measure_floor`'s `auto`). Every setting is checked before anything is loaded or timed."""
    out = {}
    named = {*KERNELS, "auto"} - {"default"}
    for setting in settings:
        kind, *flags = setting.split("+")
        kernels = [f for f in flags if f in named]
        if (
            kind not in ("dynamic", "static")
            or not set(flags) <= {"compile", *named}
            or len(set(flags)) < len(flags)
            or len(kernels) > 1
        ):
            raise ValueError(
                f"floor.settings: {setting!r} is not RUNNER[+compile][+{'|+'.join(sorted(named))}] "
                "with RUNNER dynamic or static"
            )
        if "compile" in flags and kind != "static":
            raise ValueError("floor.settings: compile needs the static runner (static+compile)")
        kernel = kernels[0] if kernels else "default"
        out[setting] = (
            kind,
            "compile" in flags,
            kernel if kernel == "auto" else check_kernels(kernel, device),
        )
    return out


def measure_floor(
    target: nn.Module,
    settings: Mapping[str, tuple[str, bool, str]],
    tokens: Sequence[int],
    context: int,
    repeats: int,
    *,
    device: str | torch.device = "cpu",
    batch_sizes: Sequence[int] = (),
    paired: bool = True,
    max_len: int = 512,
    buffer_mb: int = 1024,
    peak_size: int = 1024,
    product_rows: Sequence[int] = (),
    seed: int = 0,
    auto: KernelChoice | None = None,
) -> dict:
    """The floor report of `target` (see the module's docstring) for every setting of
    `parse_settings`, a setting of kernels auto running on `auto`'s choice (the kernels
    decoding's kernels=auto chose here, recorded in the report): the machine's bandwidth and peak,
    each linear shape's products of `product_rows` rows, and each setting's forwards of every
    `tokens` count after `context` committed tokens, for one sequence and each of `batch_sizes`,
    the settings taking turns forward by forward; `paired`: a streaming read beside each timed
    forward. Leaves the target on the default kernels."""
    if any(kernels == "auto" for _, _, kernels in settings.values()) and auto is None:
        raise ValueError(
            "measure_floor: a setting of kernels auto, but no choice of kernels (auto) was given"
        )
    settings = {
        name: (kind, compiled, auto.kernels if kernels == "auto" else kernels)
        for name, (kind, compiled, kernels) in settings.items()
    }
    probe = BandwidthProbe(device, megabytes=buffer_mb)
    bandwidth = probe(5)
    gflops = peak_gflops(device, size=peak_size, dtype=next(target.parameters()).dtype)
    report = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "context": context,
        "repeats": repeats,
        "tokens": list(tokens),
        "bandwidth_gb_s": bandwidth,
        "weight_bytes": weight_bytes(target),
        "peak_gflops": gflops,
        "peak_size": peak_size,
        "flops_per_token": linear_flops(target),
        "torch": torch.__version__,
        "settings": {},
    }
    if auto is not None:
        report["auto_kernels"] = {"kernels": auto.kernels, "ms": auto.ms}
    if product_rows:
        report["products"] = product_costs(target, list(product_rows), repeats=repeats)
    # the settings take turns forward by forward (settings_costs), on their own kernels: switching
    # keeps every setting's packed weights (release=False), so a turn costs no packing
    turns = {
        setting: Setting(
            runner_factory(target, kind, "default" if compiled else None, max_len=max_len),
            functools.partial(use_kernels, target, kernels, release=False),
        )
        for setting, (kind, compiled, kernels) in settings.items()
    }
    steps, measured = (
        {},
        {},
    )  # setting -> its 1-token step of one sequence; name -> (costs, batch, setting)
    for batch in sorted({1, *batch_sizes}):  # a batch's forwards: B x n tokens
        costs = settings_costs(
            target,
            turns,
            tokens,
            context,
            repeats,
            seed=seed,
            batch=batch,
            probe=probe if paired else None,
        )
        for setting, by_size in costs.items():
            name = setting if batch == 1 else f"{setting} x{batch}"
            steps.setdefault(setting, by_size[1].ms if 1 in by_size else None)
            measured[name] = (by_size, batch, setting)
            print(
                f"[floor] {name}: "
                + ", ".join(
                    f"{n} tokens {c.ms:.1f} ms"
                    + (f" ({c.paired_floors:.2f} floors, paired)" if c.paired_floors else "")
                    for n, c in by_size.items()
                )
            )
    # the floor is the fastest read of the memory: the first probe, or a faster one paired with a
    # forward (the memory changes phase: a first probe in a slow one put steps at 0.89 "floors")
    reads = [
        gb
        for by_size, _, _ in measured.values()
        for c in by_size.values()
        for gb in c.bandwidth_gb_s
    ]
    report["first_probe_gb_s"], bandwidth = bandwidth, max([bandwidth, *reads])
    report["bandwidth_gb_s"], report["floor_ms"] = (
        bandwidth,
        report["weight_bytes"] / (bandwidth * 1e9) * 1e3,
    )
    for name, (by_size, batch, setting) in measured.items():
        report["settings"][name] = floor_report(
            target, bandwidth, by_size, steps[setting], batch, gflops
        )
    use_kernels(target, "default")  # frees what the settings packed
    return report


def markdown(report: dict) -> str:
    """floor.md: the machine's bandwidth and floor, then one table per kernel setting."""
    lines = [
        f"### The memory floor of {report['target']} ({report['dtype']}, {report['threads']} "
        "threads, "
        f"{report['device']})",
        "",
        f"Weights: {report['weight_bytes'] / 1e6:.0f} MB, read once per step. Streaming read "
        "bandwidth: "
        f"{report['bandwidth_gb_s']:.1f} GB/s (the fastest read of the run). Floor of one step: "
        f"**{report['floor_ms']:.1f} ms**. "
        f"Arithmetic: {report['flops_per_token'] / 1e9:.2f} GFLOP per token in the linears, at "
        "most "
        f"{report['peak_gflops']:.0f} GFLOP/s here (a {report['peak_size']}^2 product), so a "
        "forward of n "
        f"tokens cannot beat its roof, max(floor, n x GFLOP per token / peak). Forwards after "
        f"{report['context']} tokens of context, median of {report['repeats']}.",
        "",
    ]
    if (
        "auto_kernels" in report
    ):  # +auto: what decoding's kernels=auto chose here, and what it timed
        auto = report["auto_kernels"]
        timed = "; ".join(
            f"{name} " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in by_width.items())
            for name, by_width in auto["ms"].items()
        )
        lines += [
            f"`+auto` ran on **{auto['kernels']}**, the kernels decoding's `kernels=auto` chose "
            f"here ({timed or NOTHING_TO_TIME}).",
            "",
        ]
    settings = report["settings"]
    paired = any(r["paired_floors"] is not None for s in settings.values() for r in s["forwards"])
    cols = "ms | floors | paired | roofs | steps" if paired else "ms | floors | roofs | steps"
    head = "| new tokens | roof ms | " + " | ".join(f"{name}: {cols}" for name in settings) + " |"
    lines += [head, "|---:|---:|" + "---:|" * (cols.count("|") + 1) * len(settings)]
    if paired:
        readings = [gb for s in settings.values() for r in s["forwards"] for gb in r["probe_gb_s"]]
        lines[-2:-2] = [
            "Paired: each forward against the floor of its own moment (a streaming read just "
            "before "
            f"it; {len(readings)} reads, {min(readings):.1f}-{max(readings):.1f} GB/s, median "
            f"{statistics.median(readings):.1f}), the median of those ratios.",
            "",
        ]
    if any(s.get("batch", 1) > 1 for s in settings.values()):
        lines[-2:-2] = [
            "A setting `xB` verifies the new tokens for each of B sequences at once (B x n tokens "
            "per "
            "forward), in steps of one sequence's 1-token step.",
            "",
        ]
    for i, n in enumerate(report["tokens"]):
        cells = []
        for setting in settings.values():
            row = setting["forwards"][i]
            steps = "-" if row["steps"] is None else f"{row['steps']:.2f}"
            pair = (
                ""
                if not paired
                else "- | "
                if row["paired_floors"] is None
                else f"{row['paired_floors']:.2f} | "
            )
            cells.append(
                f"{row['ms']:.1f} | {row['floors']:.2f} | {pair}{row['roofs']:.2f} | {steps}"
            )
        roof = next(iter(settings.values()))["forwards"][i]["roof_ms"]  # of one sequence's n tokens
        lines.append(f"| {n} | {roof:.1f} | " + " | ".join(cells) + " |")
    if report.get("products"):
        lines += [
            "",
            "Each product a step runs, by weight shape, of a few rows, per kernel setting (the "
            "target's "
            "own weights of that shape in turn, best of a few passes; on oneDNN, q/k/v and gate/up "
            "share one "
            "product each):",
            "",
            products_markdown(report["products"]).rstrip(),
        ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class FloorConfig:
    """configs/decode.yaml's `floor` section, whose comments give each setting's reason."""

    dtype: str  # auto: the dtype a decoding step runs in here
    buffer_mb: int  # the streaming read that measures bandwidth
    paired: bool  # also a streaming read beside each timed forward
    peak_size: int  # the square product that measures the peak rate
    product_rows: Sequence[int] | None  # each linear shape's products of these many rows
    tokens: Sequence[int]  # new tokens per forward
    context: int  # committed tokens before the forwards
    repeats: int  # forwards per size
    settings: Sequence[str]  # RUNNER[+compile][+KERNELS|+auto] (`parse_settings`)
    max_len: int  # static cache slots
    batch_sizes: Sequence[int]  # also each forward for B sequences at once
    out_dir: str | Path


def run_floor(target_path: str, fc: FloorConfig, device: str = "cpu", seed: int = 0) -> Path:
    """The memory floor of the target in `target_path` on this machine and its forwards of n
    new tokens, for each runner setting of `fc.settings` (`measure_floor`). Every setting is
    checked before the target loads. Writes floor.json and floor.md; returns their folder."""
    from eagle.artifacts import write_report
    from eagle.bench.builder import choose_kernels
    from eagle.hardware import resolve_dtype_name
    from eagle.target import load_target, resolve_dtype

    settings = parse_settings(fc.settings, device)
    dtype = resolve_dtype_name(fc.dtype, device, wide=False)
    target, _ = load_target(
        target_path, dtype=resolve_dtype(dtype), device=device, with_tokenizer=False
    )
    auto = None  # +auto: the kernels decoding's kernels=auto would choose here (timed once)
    if any(kernels == "auto" for _, _, kernels in settings.values()):
        chosen = choose_kernels(target, "auto", device, dtype)
        auto = chosen if isinstance(chosen, KernelChoice) else KernelChoice(kernels=chosen, ms={})
    report = measure_floor(
        target,
        settings,
        tokens=list(fc.tokens),
        context=fc.context,
        repeats=fc.repeats,
        device=device,
        batch_sizes=[int(b) for b in fc.batch_sizes],
        paired=fc.paired,
        max_len=fc.max_len,
        buffer_mb=fc.buffer_mb,
        peak_size=fc.peak_size,
        product_rows=[int(n) for n in fc.product_rows or []],
        seed=seed,
        auto=auto,
    )
    report = {"kind": "floor", "target": str(target_path), "dtype": dtype, **report}
    return write_report(fc.out_dir, "floor", report, markdown(report))

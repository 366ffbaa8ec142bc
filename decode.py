"""Decode with any method (streaming), or benchmark every method side by side.

    python decode.py "prompt='def fib(n):'" method=eagle    # streams each accepted block
    python decode.py method=vanilla temperature=0.8 top_p=0.95
    python decode.py mode=benchmark                         # writes results.json/.md + plots
    python decode.py mode=tree_search                       # the best static tree for this machine
    python decode.py method=eagle runner=static compile=true   # static caches, compiled passes
    python decode.py mode=timing device=cuda compile=true timing.tau_from=runs/bench/X/results.json
                                                            # 7B-shaped random weights: round cost
    python decode.py mode=export export.formats=[sglang]    # the drafter for vLLM / SGLang / EAGLE

    python decode.py mode=coverage                          # SpecInfer's SSMs: coverage per SSM and union
    python decode.py mode=profile                           # where EAGLE's round goes, part by part
    python decode.py mode=ablations                         # EAGLE-1's ablation drafters (make ablations)
    python decode.py mode=floor                             # the target's step against the memory floor
    python decode.py mode=benchmark kernels=onednn          # the linears on oneDNN's packed products (auto: timed)
    python decode.py mode=batch batch.sizes=[1,2,4,8]       # every method at several batch sizes
    python decode.py "prompts=[a,b,c]" method=eagle         # several prompts at once, each streamed

Methods are named NAME[@TREE][:RUNNER] (eagle/bench/methods.py): vanilla | eagle | draft |
specinfer_merge | prompt_lookup | medusa | medusa_typical | hf_generate | hf_assisted | hf_prompt_lookup;
`eagle@chain5` runs a tree method with another tree, `eagle:static` on static caches. All are
lossless except medusa_typical (Medusa's typical acceptance), which is labelled LOSSY wherever
it reports. The benchmark, the tree search and the timing print their output folder last.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from eagle.artifacts import files_stamp, keep_previous
from eagle.bench.benchmark import (
    BenchmarkConfig,
    encode_prompt,
    run_benchmark,
    warm_up,
    warmup_budget,
)
from eagle.bench.evalsets import Prompt, load_eval_set, select
from eagle.bench.floor import weight_bytes
from eagle.bench.methods import (
    SECTIONS,
    MethodContext,
    MethodError,
    MethodSpec,
    build_method,
    method_dtype,
    method_settings,
)
from eagle.bench.precision import DtypeChoice, KernelChoice, faster_dtype, faster_kernels, preferred
from eagle.bench.timing import project, random_target, time_methods, write_timing
from eagle.bench.tree_search import (
    Candidate,
    MachineCost,
    candidates,
    choose_for_machine,
    position_paths,
    write_tree,
)
from eagle.cli import run_cli
from eagle.decoding.kernels import (
    KERNELS,
    PACKED_DTYPES,
    available_kernels,
    check_kernels,
    free_memory_bytes,
    packed_bytes,
    use_kernels,
)
from eagle.hardware import auto_dtype, gpu_bandwidth_gb_s, resolve_dtype_name, set_threads
from eagle.sampling import SamplingPolicy, seeded_generator
from eagle.target import load_target, resolve_dtype
from eagle.tree import TreeError, TreeTemplate, resolve_tree

ROOT = Path(__file__).resolve().parent
TREE_DIR = ROOT / "configs" / "tree"


def compile_mode(cfg: DictConfig) -> str | None:
    """`compile=true`: CUDA graphs on a GPU (the per-token launch overhead is what they remove),
    plain inductor code elsewhere."""
    if not cfg.compile:
        return None
    return "reduce-overhead" if str(cfg.device).startswith("cuda") else "default"


def choose_kernels(model: torch.nn.Module, kernels: str, device, name: str) -> KernelChoice | str:
    """The linear kernels for `model` (the target in one dtype, `name`): `kernels` as named, or
    with auto the setting measured faster on it (eagle.bench.precision.faster_kernels), unless
    there is nothing to choose or a packed copy may not fit. Decoding and the floor's `+auto` both
    choose here, so the floor times what decoding runs."""
    choices = available_kernels(device)
    if kernels != "auto":
        return check_kernels(kernels, device)
    if len(choices) == 1 or resolve_dtype(name) not in PACKED_DTYPES:
        return "default"  # nothing to choose: no packed products for this device or dtype
    if (free := free_memory_bytes()) is not None and (extra := packed_bytes(model)) > free / 2:
        print(f"[kernels] {name}: default (packing the linears would take {extra / 1e9:.1f} GB "  # a 7B float32
              f"of the {free / 1e9:.1f} GB free; kernels=onednn forces it)", file=sys.stderr, flush=True)  # target
        return "default"
    choice = faster_kernels(model, kernels=choices)
    print(f"[kernels] {name}: {choice.describe()}", file=sys.stderr, flush=True)  # not in the text
    return choice


class Methods:
    """Builds methods from the decode config; targets and draft LMs are loaded once per dtype."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.sections = {name: OmegaConf.to_container(cfg[name], resolve=True) for name in SECTIONS}
        self._targets: dict[torch.dtype, tuple] = {}
        self._drafts: dict[tuple[str, torch.dtype], torch.nn.Module] = {}
        self.measured: dict[int, DtypeChoice] = {}  # tree width -> the dtype measured faster
        self.kernels: dict[str, KernelChoice | str] = {}  # dtype -> the linear kernels of its models (cfg.kernels)
        if cfg.kernels != "auto":  # a typo fails before anything is loaded
            check_kernels(cfg.kernels, cfg.device)

    def probed(self, spec: str, overrides: dict[str, str] | None = None) -> bool:
        """Whether `dtype` measures `spec`'s dtype rather than taking its override or the machine's
        choice (`method_dtype`): where that choice is bf16 for a wide method on a CPU."""
        spec, overrides = MethodSpec.parse(spec), overrides or {}
        explicit = overrides.get(str(spec)) or overrides.get(spec.base)
        return (method_dtype(spec, self.cfg.device, overrides) == "bfloat16"
                and torch.device(self.cfg.device).type == "cpu" and explicit in (None, "auto"))

    def dtype(self, spec: str, overrides: dict[str, str] | None = None, tree_dirs: tuple[str, ...] = ()) -> str:
        """The dtype `spec` runs in: its override, else the machine's choice (`method_dtype`),
        except that where that choice is bf16 for a wide method on a CPU (`probed`), the faster
        dtype is measured on the target instead of assumed (eagle.bench.precision), once per tree width."""
        if not self.probed(spec, overrides):
            return method_dtype(MethodSpec.parse(spec), self.cfg.device, overrides or {})
        spec = MethodSpec.parse(spec)
        tree = getattr(method_settings(spec, self.sections), "tree", None) or self.cfg.eagle.tree
        if searched := searched_dtype(tree):
            print(f"[dtype] {spec}: {searched}, as the tree search that chose {tree} measured it")
            return searched
        width = resolve_tree(tree, (*tree_dirs, str(TREE_DIR))).num_nodes + 1  # the root and the tree
        if width not in self.measured:
            choice = faster_dtype({name: self.target(name)[0] for name in ("float32", "bfloat16")}, width)
            if choice.dtype == "float32":  # the bf16 copy was loaded only to be timed
                self._targets.pop(torch.bfloat16, None)
            print(f"[dtype] {spec}: {choice.describe()}")
            self.measured[width] = choice
        return self.measured[width].dtype

    def target(self, dtype: str):
        key = resolve_dtype(dtype)
        if key not in self._targets:
            self._targets[key] = load_target(self.cfg.target, dtype=key, device=self.cfg.device)
            self._use_kernels(self._targets[key][0], dtype)
        return self._targets[key]

    def _use_kernels(self, model: torch.nn.Module, dtype: str) -> None:
        """`cfg.kernels` on a model of `dtype`: the setting named, or with auto the one measured
        faster on the target in that dtype (eagle.bench.precision.faster_kernels); every model
        of a dtype (target, draft LMs, drafters) then runs the same kernels."""
        name = str(resolve_dtype(dtype)).removeprefix("torch.")
        if name not in self.kernels:
            self.kernels[name] = choose_kernels(model, self.cfg.kernels, self.cfg.device, name)
        choice = self.kernels[name]
        use_kernels(model, choice if isinstance(choice, str) else choice.kernels)

    def _draft_lm(self, dtype: str):
        def load(path: str) -> torch.nn.Module:
            key = (str(path), resolve_dtype(dtype))
            if key not in self._drafts:
                self._drafts[key], _ = load_target(path, dtype=key[1], device=self.cfg.device, with_tokenizer=False)
                self._use_kernels(self._drafts[key], dtype)
            return self._drafts[key]
        return load

    def context(self, dtype: str, tree_dirs: tuple[str, ...] = (), target=None) -> MethodContext:
        cfg = self.cfg
        target, tokenizer = (target, None) if target is not None else self.target(dtype)
        return MethodContext(target=target, tokenizer=tokenizer, target_path=str(cfg.target),
                             tree_dirs=(*tree_dirs, str(TREE_DIR)), draft_lm=self._draft_lm(dtype),
                             runner=cfg.runner, static_max_len=cfg.static_max_len, compile_mode=compile_mode(cfg))

    def build(self, name: str, dtype: str, tree_dirs: tuple[str, ...] = ()):
        return build_method(name, self.context(dtype, tree_dirs), self.sections)


def searched_dtype(tree: str) -> str | None:
    """The dtype the tree search timed `tree` in, where `tree` is the path of a file it wrote
    (machine.yaml, or a candidate beside it, with their machine.json): the tree was chosen for
    its round in that dtype, and timing the dtypes again minutes later on a shared machine can
    decide otherwise (LOG.md). None for any other tree."""
    path = Path(str(tree))
    record = path.parent / "machine.json"
    if path.suffix not in (".yaml", ".yml") or not path.is_file() or not record.is_file():
        return None
    try:
        machine = json.loads(record.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{record}, the tree search's record beside {path}, is not valid JSON ({err}): "
                         "rerun the tree search, or delete it to time the dtypes here") from err
    dtypes = machine.get("dtypes", {})
    if path.stem == "machine" and "machine" not in dtypes:  # a record written before machine*.yaml had entries
        return dtypes.get(machine.get("chosen"))
    return dtypes.get(path.stem)


def generate(cfg: DictConfig) -> None:
    policy = SamplingPolicy(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)  # a typo fails before loading
    methods = Methods(cfg)
    dtype = methods.dtype(cfg.method, {} if cfg.dtype == "auto" else {cfg.method: cfg.dtype})
    method = methods.build(cfg.method, dtype)
    _, tokenizer = methods.target(dtype)
    generator = seeded_generator(cfg.seed, cfg.device)
    torch.manual_seed(cfg.seed)
    if cfg.prompts:
        return generate_batch(cfg, method, dtype, tokenizer, policy, generator)
    ids = encode_prompt(tokenizer, Prompt(id="cli", text=str(cfg.prompt), chat=bool(cfg.chat)))
    shown: list[int] = []
    printed = ""

    def stream(block: list[int]) -> None:  # decode everything so far: multi-byte tokens print whole
        nonlocal printed
        shown.extend(block)
        text = tokenizer.decode(shown, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    print(tokenizer.decode(ids, skip_special_tokens=True), end="", flush=True)
    out = method.generate(ids, cfg.max_new_tokens, policy, generator, on_commit=stream)
    label = "" if method.lossless else f", LOSSY ({method.lossy})"
    print(f"\n\n[{method.name}, {dtype}{label}] {len(out.tokens)} tokens in {out.seconds:.2f}s: "
          f"{len(out.tokens) / out.seconds:.1f} tokens/s, tau {out.tau:.2f}")


def generate_batch(cfg: DictConfig, method, dtype: str, tokenizer, policy: SamplingPolicy, generator) -> None:
    """`prompts=[...]`: every prompt decoded at once, in one batch; each committed block is
    printed as it comes, tagged with its prompt's number, then every full text."""
    batch = [encode_prompt(tokenizer, Prompt(id=f"cli{i}", text=str(p), chat=bool(cfg.chat)))
             for i, p in enumerate(cfg.prompts)]
    shown: list[list[int]] = [[] for _ in batch]

    def stream(row: int, block: list[int]) -> None:
        before = tokenizer.decode(shown[row], skip_special_tokens=True)
        shown[row].extend(block)
        print(f"[{row}] {tokenizer.decode(shown[row], skip_special_tokens=True)[len(before):]!r}", flush=True)

    start = time.perf_counter()
    outs = method.generate_batch(batch, cfg.max_new_tokens, policy, generator, on_commit=stream)
    seconds = time.perf_counter() - start
    label = "" if method.lossless else f", LOSSY ({method.lossy})"
    for row, (ids, out) in enumerate(zip(batch, outs)):
        print(f"\n[{row}] {tokenizer.decode(ids + out.tokens, skip_special_tokens=True)}\n"
              f"[{row}] {len(out.tokens)} tokens, tau {out.tau:.2f}")
    tokens = sum(len(o.tokens) for o in outs)
    print(f"\n[{method.name}, {dtype}{label}] {len(batch)} sequences at once: {tokens} tokens in {seconds:.2f}s, "
          f"{tokens / seconds:.1f} tokens/s")


def dtype_overrides(spec) -> dict[str, str]:
    """`benchmark.dtypes` as {method label or base name: dtype}. Given as a mapping
    (`benchmark.dtypes={eagle:float32}`) or, for labels Hydra's override grammar cannot spell as
    keys (`eagle@chain5`, `vanilla:dynamic`), as a list of LABEL=DTYPE strings
    (`'benchmark.dtypes=["vanilla:dynamic=bfloat16"]'`)."""
    if not spec:
        return {}
    spec = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else spec
    if isinstance(spec, dict):
        return {str(k): str(v) for k, v in spec.items()}
    out = {}
    for item in spec:
        label, eq, dtype = str(item).rpartition("=")
        if not eq or not label or not dtype:
            raise ValueError(f"benchmark.dtypes: {item!r} is not LABEL=DTYPE (e.g. vanilla:dynamic=bfloat16)")
        out[label] = dtype
    return out


def benchmark(cfg: DictConfig, methods: Methods | None = None, names: list[str] | None = None,
              temperatures: list[float] | None = None, out_dir: str | Path | None = None,
              tree_dirs: tuple[str, ...] = (), dtypes: dict[str, str] | None = None) -> Path:
    """Run the benchmark (arguments override `cfg.benchmark`; `dtypes`, label -> dtype, add to
    `benchmark.dtypes`); returns its output folder."""
    bcfg = cfg.benchmark
    methods = methods or Methods(cfg)
    names = list(names or bcfg.methods)
    dtypes = dtype_overrides(bcfg.dtypes) | (dtypes or {})
    for name in names:
        MethodSpec.parse(name)  # unknown names fail before any model is loaded
    eval_sets = {Path(name).stem: load_eval_set(name, bcfg.num_prompts) for name in bcfg.eval_sets}
    _, tokenizer = methods.target(methods.dtype("vanilla", dtypes))
    chat = bcfg.chat if bcfg.chat is not None else (True if cfg.chat else None)
    if chat is not None:  # one rendering for every prompt, instead of each set's own
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"benchmark.chat=true, but the target {cfg.target}'s tokenizer has no chat template")
        eval_sets = {k: [dataclasses.replace(p, chat=bool(chat)) for p in v] for k, v in eval_sets.items()}

    def build(name: str):
        dtype = methods.dtype(name, dtypes, tree_dirs)
        return methods.build(name, dtype, tree_dirs), dtype

    config = BenchmarkConfig(methods=tuple(names), temperatures=tuple(temperatures or bcfg.temperatures),
                             max_new_tokens=cfg.max_new_tokens, warmup=bcfg.warmup,
                             warmup_tokens=bcfg.warmup_tokens, top_k=cfg.top_k,
                             top_p=cfg.top_p, seed=cfg.seed)
    out_dir = Path(out_dir or bcfg.out_dir)
    key = resume_key(cfg, names, config.temperatures, dtypes, tree_dirs, eval_sets) if bcfg.resume else None
    run_benchmark(eval_sets, tokenizer, build, config, target_name=str(cfg.target), out_dir=out_dir,
                  device=cfg.device, reference=lambda dtype: methods.build("vanilla", dtype),
                  dtype_choices=methods.measured, kernels=methods.kernels, resume_key=key)
    print((out_dir / "results.md").read_text())
    return out_dir


# the settings a benchmark's measurements depend on (the other sections belong to other modes)
MEASURED_SETTINGS = ("target", "runner", "static_max_len", "compile", "kernels", "eagle", "eagle_lookup", "draft",
                     "specinfer", "prompt_lookup", "medusa", "chat", "top_k", "top_p", "seed", "max_new_tokens", "device")


def resume_key(cfg: DictConfig, names: list[str], temperatures, dtypes: dict, tree_dirs, eval_sets: dict,
               section: str = "benchmark") -> dict:
    """What decides a benchmark's measurements: the settings, the methods, their trees and the
    prompts, the threads and libraries timing them, and the stamps of the files they read (a
    drafter retrained in the same folder is another drafter), so a stopped run resumes only when
    nothing of it changed (eagle.bench.benchmark.run_benchmark; `section` "batch":
    eagle.bench.batch.run_batch_benchmark, `names` with each batch size's tree filled in)."""
    settings = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
                for k in MEASURED_SETTINGS if k in cfg}
    bench = OmegaConf.to_container(cfg[section], resolve=True)
    bench.pop("out_dir", None)  # a time stamp by default; the folder is where the report is found
    files = [str(cfg.target), str(cfg.eagle.drafter), str(cfg.draft.model), *map(str, cfg.specinfer.models),
             str(cfg.medusa.heads), *map(str, cfg[section].eval_sets)]
    trees = {}  # each method's tree as drafted: a name in tree_dirs (the tree search's comparison) or
    for name in names:  # a file may hold another tree than when the stopped run read it
        spec = MethodSpec.parse(name)
        tree = spec.tree or (settings.get(spec.info.section) or {}).get("tree")
        try:
            trees[name] = list(resolve_tree(tree, (*tree_dirs, str(TREE_DIR))).parents) if tree else None
        except (TreeError, OSError):
            trees[name] = None  # building the method says what is wrong with it
    return {"settings": settings, "benchmark": bench, "methods": list(names), "trees": trees,
            "temperatures": [float(t) for t in temperatures], "dtypes": dict(dtypes), "tree_dirs": list(tree_dirs),
            "prompts": {k: [[p.id, p.chat, hashlib.sha256(p.text.encode()).hexdigest()[:16]] for p in v]
                        for k, v in eval_sets.items()}, "inputs": files_stamp(files),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform()}


def tree_search(cfg: DictConfig) -> Path:
    """Run the probe tree from every position of each prompt's greedy text, keep the best
    subtree of each size (eagle/bench/tree_search.py), then benchmark them against vanilla and
    the default tree; the predicted and measured taus are written side by side."""
    ts, bcfg = cfg.tree_search, cfg.benchmark
    out = Path(ts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    methods = Methods(cfg)
    overrides = dtype_overrides(bcfg.dtypes)
    # the probe's texts in float32 on a CPU, unless a dtype is asked for: every tree decodes the same
    # text there, so the predicted taus are exact, and a bf16 probe timed faster at EAGLE-1's width
    # made the search follow the machine's load (two runs on an AMX Xeon chose different trees, LOG.md)
    dtype = "float32" if methods.probed("eagle", overrides) else methods.dtype("eagle", overrides)
    probe = resolve_tree(ts.probe, [TREE_DIR])
    method = methods.build(f"eagle@{ts.probe}", dtype)
    _, tokenizer = methods.target(dtype)
    sets = [load_eval_set(name) for name in bcfg.eval_sets]  # each read once (unseen_code scans packages)
    # the search tunes on prompts the benchmark (and the comparison below) does not take, from the same categories
    searched = [p for every in sets for p in select(every, ts.num_prompts, held_out_from=bcfg.num_prompts)]
    prompts = [encode_prompt(tokenizer, p) for p in searched]
    benchmarked = {p.id for every in sets for p in select(every, bcfg.num_prompts)}
    if seen := [p.id for p in searched if p.id in benchmarked]:
        print(f"[tree search] note: {len(seen)} of the searched prompts are among the benchmark's first "
              f"{bcfg.num_prompts} of each set (a set too short for both): its figures there are not held out")
    greedy = SamplingPolicy()

    def first_round(ids: list[int], max_new: int) -> tuple[int, ...]:
        rounds = method.generate(ids, max_new, greedy).stats.rounds
        return rounds[0].path if rounds else (0,)

    paths = []
    for ids in tqdm(prompts, desc=f"probe {probe.num_nodes} nodes, every position", unit="prompt"):
        text = method.generate(ids, cfg.max_new_tokens, greedy).tokens
        paths.append(position_paths(first_round, probe, ids, text))
    (out / "probe_paths.json").write_text(json.dumps({"probe": probe.name, "paths": paths}))
    found = candidates(probe, paths, list(ts.sizes), cfg.max_new_tokens)
    for c in found:
        write_tree(c, out / f"{c.tree.name}.yaml", source=f"{probe.name} over {len(prompts)} prompts")
        print(f"[tree search] {c.tree.summary()}: predicted tau {c.predicted_tau:.2f}")
    cost, plain_ms, dtypes = measure_round_cost(cfg, methods, prompts, found, out)
    vanilla_ms = min(plain_ms.values())  # the fastest plain decoding: the benchmark's "vs fastest"
    print("[tree search] plain decoding: " + ", ".join(f"{d} {ms:.1f} ms" for d, ms in plain_ms.items()))
    ranking = choose_for_machine(found, cost, vanilla_ms)
    for r in ranking:
        r["dtype"] = dtypes[r["tree"]]
        print(f"[tree search] {r['tree']}: predicted round {r['predicted_round_ms']:.1f} ms in {r['dtype']}, "
              f"speedup {r['predicted_speedup']:.2f}x (tau {r['predicted_tau']:.2f})")
    chosen = next(c for c in found if c.tree.name == ranking[0]["tree"])
    write_tree(chosen, out / "machine.yaml", source=f"{chosen.tree.name}, chosen by the cost model of this machine")
    # the dtype of every tree the cost model measured, and of each machine*.yaml written (searched_dtype)
    # what the search was asked, in one line that make's stage markers grep (a tree searched with
    # another drafting vocabulary or among other sizes is not the one asked for)
    sizes = ",".join(str(int(s)) for s in ts.sizes)
    machine = {"searched_with": f"draft_vocab={cfg.eagle.draft_vocab} sizes=[{sizes}]", "drafter": str(cfg.eagle.drafter),
               "chosen": chosen.tree.name, "searched_prompts": [p.id for p in searched],
               "vanilla_ms": vanilla_ms, "vanilla_ms_by_dtype": plain_ms,
               "cost_model": cost.to_dict(), "ranking": ranking, "dtypes": {**dtypes, "machine": dtypes[chosen.tree.name]}}
    print(f"[tree search] the tree for this machine: {chosen.tree.summary()} -> {out / 'machine.yaml'}")
    if ranking[0]["predicted_speedup"] < 1.0:  # said, not silent: the benchmark will show EAGLE behind plain decoding
        print(f"[tree search] WARNING: no candidate is predicted faster than plain decoding on this machine "
              f"(best: {chosen.tree.name}, {ranking[0]['predicted_speedup']:.2f}x at tau {ranking[0]['predicted_tau']:.2f}, "
              f"a round {ranking[0]['predicted_round_ms']:.1f} ms against {vanilla_ms:.1f} ms a token): the drafter "
              "accepts too little for what a round costs here; train it longer (make demo-long) or on data "
              "closer to the target's (make selfdistill)")
    if ts.batch_sizes:  # the tree per batch size: a busier target wants a smaller one
        machine["batch"] = {}
        for size in sorted({int(b) for b in ts.batch_sizes}):
            cost_b, plain_b, dtypes_b = (cost, plain_ms, dtypes) if size == 1 else measure_round_cost(
                cfg, methods, prompts, found, out, size=size)
            vanilla_b = min(plain_b.values())
            ranked = choose_for_machine(found, cost_b, vanilla_b)
            pick = next(c for c in found if c.tree.name == ranked[0]["tree"])
            write_tree(pick, out / f"machine_b{size}.yaml",
                       source=f"{pick.tree.name}, chosen by the cost model of batches of {size} on this machine")
            for r in ranked:
                r["dtype"] = dtypes_b[r["tree"]]
            machine["batch"][str(size)] = {"chosen": pick.tree.name, "vanilla_ms": vanilla_b,
                                           "cost_model": cost_b.to_dict(), "ranking": ranked, "dtypes": dtypes_b}
            machine["dtypes"][f"machine_b{size}"] = dtypes_b[pick.tree.name]
            print(f"[tree search] batches of {size}: {pick.tree.summary()} (predicted {ranked[0]['predicted_speedup']:.2f}x "
                  f"over vanilla batches of {size}) -> {out / f'machine_b{size}.yaml'}")
    if ts.sampled_temperature:
        sample_prompts = [encode_prompt(tokenizer, p) for every in sets
                          for p in select(every, ts.sampled_prompts, held_out_from=bcfg.num_prompts)]
        sampled = rank_sampled(cfg, methods, sample_prompts, found, out, float(ts.sampled_temperature), dtypes)
        best = next(c for c in found if c.tree.name == sampled["ranking"][0]["tree"])
        name = f"machine_t{sampled['temperature']:g}.yaml"
        write_tree(best, out / name, source=f"{best.tree.name}, the fastest decoded at T={sampled['temperature']:g}")
        machine["sampled"] = {**sampled, "chosen": best.tree.name}
        machine["dtypes"][Path(name).stem] = dtypes[best.tree.name]
        print(f"[tree search] at T={sampled['temperature']:g}: {best.tree.summary()} -> {out / name}")
    (out / "machine.json").write_text(json.dumps(machine, indent=2))
    if not ts.compare:
        return out
    names = ["vanilla", "eagle"] + [f"eagle@{c.tree.name}" for c in found]
    # vanilla in the dtype the cost model timed fastest: the predictions are against it, so are the measurements
    fastest = min(plain_ms, key=plain_ms.get)
    compare = benchmark(cfg, methods, names=names, temperatures=list(ts.temperatures), out_dir=out / "compare",
                        tree_dirs=(str(out),), dtypes={"vanilla": fastest, **{f"eagle@{c.tree.name}": dtypes[c.tree.name]
                                                                              for c in found}})
    summary = []

    def per_token_ms(m: dict) -> float:  # the rounds only, as the prediction (prefill excluded)
        return m["ms_per_round"] / m["tau"]

    for run in json.loads((compare / "results.json").read_text())["runs"]:
        ms = run["methods"]
        rows = [{"eval_set": run["eval_set"], "temperature": run["temperature"], "tree": c.tree.name,
                 "nodes": c.tree.num_nodes, "depth": c.tree.depth, "predicted_tau": c.predicted_tau,
                 "tau": ms[f"eagle@{c.tree.name}"]["tau"],
                 "speedup": ms[f"eagle@{c.tree.name}"]["speedup"],  # tokens/s, prefill included
                 "rounds_speedup": per_token_ms(ms["vanilla"]) / per_token_ms(ms[f"eagle@{c.tree.name}"])}
                for c in found]
        summary += rows
        default, best = run["methods"]["eagle"], max(rows, key=lambda r: r["speedup"])
        print(f"[tree search] {run['eval_set']} T={run['temperature']:g}: default tree {default['speedup']:.2f}x "
              f"(tau {default['tau']:.2f}); best candidate {best['tree']} {best['speedup']:.2f}x "
              f"(tau {best['tau']:.2f}, predicted {best['predicted_tau']:.2f}): eagle.tree={out / best['tree']}.yaml")
    predicted = {r["tree"]: r for r in ranking}
    for row in summary:  # predicted_speedup compares with rounds_speedup: both leave the prefill out
        row |= {k: predicted[row["tree"]][k] for k in ("predicted_round_ms", "predicted_speedup")}
        row["machine_choice"] = row["tree"] == chosen.tree.name
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return out


def bench_dtype(cfg: DictConfig, methods: Methods, out: Path, label: str) -> str:
    """The dtype `Methods.dtype` gives `label` (`vanilla`, or `eagle@<tree of out>`): on a CPU with
    bf16, for a tree the faster one at its width in one timed forward (a small tree may verify
    faster in float32 than EAGLE-1's 26 tokens do). The cost model starts from it and decides
    between it and float32 by the trees' rounds (`measure_round_cost`)."""
    return methods.dtype(label, dtype_overrides(cfg.benchmark.dtypes), tree_dirs=(str(out),))


def rotated(names: list[str], i: int) -> list[str]:
    """`names` starting at its i-th (mod its length): the order methods take turn i in, so that
    none is always first after the others have warmed the caches or met a busier machine."""
    return names[i % len(names):] + names[: i % len(names)]


def plain_dtypes(cfg: DictConfig, methods: Methods, out: Path) -> list[str]:
    """The dtypes plain decoding is timed in beside the trees: vanilla's own and, where bf16 is
    fast, bf16 too; the fastest of them is the benchmark's "vs fastest" baseline."""
    return list(dict.fromkeys([bench_dtype(cfg, methods, out, "vanilla"), auto_dtype(cfg.device, wide=True)]))


def measure_round_cost(cfg: DictConfig, methods: Methods, prompts: list[list[int]],
                       found: list, out: Path, size: int = 1) -> tuple[MachineCost, dict[str, float], dict[str, str]]:
    """Rounds measured on chains and on the candidate trees (short greedy decodes of a few
    batches of `size` prompts), fitted per dtype into a `MachineCost`; the round of plain decoding on the
    same batches in each dtype a benchmark compares (vanilla's own and, where bf16 is fast, bf16:
    the fastest is the "vs fastest" baseline); and the dtype of each tree. A batch round drafts
    every sequence's tree and verifies them all in one forward.

    On a CPU, a tree whose width the dtype probe (`bench_dtype`) timed faster in bf16 decodes here
    in both dtypes (unless `benchmark.dtypes` names its dtype), and keeps float32 unless its bf16
    rounds are faster by more than `tree_search.dtype_margin`: one verification forward timed
    alone chose bf16 where the benchmark's 7-token bf16 rounds then cost more than float32's
    (LOG.md). The cost model prices each tree in the dtype kept, from a fit of the rounds timed in
    that dtype only (`MachineCost`).

    The methods take turns batch by batch, in an order rotated at each batch: on a shared
    machine the same forward can cost 40% more a few minutes later (LOG.md), and timing one
    tree after another let that drift rank the trees."""
    from eagle.bench.batch import summarise

    ts, greedy = cfg.tree_search, SamplingPolicy()
    trees = [TreeTemplate.chain(k, name=f"chain{k}") for k in ts.cost_chains] + [c.tree for c in found]
    for tree in trees[: len(ts.cost_chains)]:
        write_tree(Candidate(tree, 0.0), out / f"{tree.name}.yaml", source="cost model calibration")
    groups = [[prompts[(i + j) % len(prompts)] for j in range(size)] for i in range(ts.cost_prompts)]
    longest = sorted(prompts, key=len, reverse=True)[:size]
    plain = plain_dtypes(cfg, methods, out)
    overrides = dtype_overrides(cfg.benchmark.dtypes)

    def tried_dtypes(tree: TreeTemplate) -> list[str]:
        """The probe's dtype for the tree and, where the probe chose another than float32, float32
        too: the rounds in turn below decide. A dtype asked for, or a GPU's, is kept as is."""
        label = f"eagle@{tree.name}"
        dtype = bench_dtype(cfg, methods, out, label)
        return [dtype, "float32"] if dtype != "float32" and methods.probed(label, overrides) else [dtype]

    tried = {tree.name: tried_dtypes(tree) for tree in trees}
    runs = {f"vanilla {d}": methods.build("vanilla", d) for d in plain} | {
        f"{tree.name} {d}": methods.build(f"eagle@{tree.name}", d, tree_dirs=(str(out),))
        for tree in trees for d in tried[tree.name]}
    for method in runs.values():  # untimed: kernels warm (and a static runner's buffers at their largest)
        method.generate_batch(longest, warmup_budget(method, ts.cost_tokens, cfg.benchmark.warmup_tokens), greedy)
    timed: dict[str, list] = {name: [] for name in runs}
    names = list(runs)
    for i, group in enumerate(tqdm(groups, desc=f"cost model: {len(names)} methods in turn", unit="batch")):
        for name in rotated(names, i):
            timed[name].append((runs[name].generate_batch(group, ts.cost_tokens, greedy), 0.0))
    per_round = {name: summarise(name, size, rows) for name, rows in timed.items()}
    round_ms = {name: r.draft_ms_per_round + r.verify_ms_per_round for name, r in per_round.items()}
    dtypes = {tree.name: preferred({d: round_ms[f"{tree.name} {d}"] for d in tried[tree.name]},
                                   "float32", float(ts.dtype_margin)) for tree in trees}  # float32 unless another wins clearly
    for tree in trees:
        if len(tried[tree.name]) > 1:
            print(f"[tree search] {tree.name}: {dtypes[tree.name]} (rounds in turn: "
                  + ", ".join(f"{d} {round_ms[f'{tree.name} {d}']:.1f} ms" for d in tried[tree.name]) + ")")
    # every round timed, in each dtype: one fit per dtype (a bf16 tree is not priced by float32's curve)
    measured = [(tree, d, per_round[f"{tree.name} {d}"].draft_ms_per_round, per_round[f"{tree.name} {d}"].verify_ms_per_round)
                for tree in trees for d in tried[tree.name]]
    plain_ms = {d: round_ms[f"vanilla {d}"] for d in plain}
    return MachineCost.fit(measured, dtypes), plain_ms, dtypes


def rank_sampled(cfg: DictConfig, methods: Methods, prompts: list[list[int]], found: list, out: Path,
                 temperature: float, dtypes: dict[str, str]) -> dict:
    """The candidates decoded at `temperature`, fastest first: the greedy search cannot see how
    siblings share a sampled round's residual, so this ranking is measured, not predicted.
    Each tree (in `dtypes`, the cost model's) and plain decoding (in each of `plain_dtypes`)
    decode every prompt for `max_new_tokens`, interleaved prompt by prompt in an order rotated at
    each prompt, so that the machine's drift reaches every tree alike; ms per token of the rounds
    (prefill excluded), and speedups against the fastest plain decoding, as the benchmark reports
    them. Sampled tau varies from prompt to prompt: more prompts, a steadier rank."""
    policy = SamplingPolicy(temperature=temperature)
    plain = {f"vanilla {d}": d for d in plain_dtypes(cfg, methods, out)}
    runs = {name: methods.build("vanilla", d) for name, d in plain.items()} | {
        c.tree.name: methods.build(f"eagle@{c.tree.name}", dtypes[c.tree.name], tree_dirs=(str(out),)) for c in found}
    seconds, committed, rounds = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0), dict.fromkeys(runs, 0)
    for method in runs.values():
        warm_up(method, prompts, cfg.max_new_tokens, policy, seeded_generator(cfg.seed, cfg.device))
    names = list(runs)
    for i, p in enumerate(tqdm(prompts, desc=f"candidates at T={temperature:g}", unit="prompt")):
        for name in rotated(names, i):
            stats = runs[name].generate(p, cfg.max_new_tokens, policy, seeded_generator(cfg.seed + i, cfg.device)).stats
            seconds[name] += stats.draft_s + stats.verify_s
            committed[name] += stats.committed
            rounds[name] += stats.forwards
    ms = {name: 1000 * seconds[name] / max(committed[name], 1) for name in runs}
    fastest = min(plain, key=ms.get)
    ranking = sorted(({"tree": c.tree.name, "nodes": c.tree.num_nodes, "tau": committed[c.tree.name] / max(rounds[c.tree.name], 1),
                       "ms_per_token": ms[c.tree.name], "speedup": ms[fastest] / ms[c.tree.name]} for c in found),
                     key=lambda r: r["ms_per_token"])
    print(f"[tree search] T={temperature:g} plain decoding: "
          + ", ".join(f"{d} {ms[name]:.2f} ms/token" for name, d in plain.items()))
    for r in ranking:
        print(f"[tree search] T={temperature:g} {r['tree']}: tau {r['tau']:.2f}, {r['ms_per_token']:.2f} ms/token, "
              f"{r['speedup']:.2f}x the fastest plain decoding ({plain[fastest]})")
    return {"temperature": temperature, "prompts": len(prompts), "tokens": int(cfg.max_new_tokens),
            "vanilla_ms_per_token": ms[fastest], "vanilla_dtype": plain[fastest],
            "vanilla_ms_per_token_by_dtype": {d: ms[name] for name, d in plain.items()}, "ranking": ranking}


def read_json(path: str, key: str) -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{key}: {path} does not exist")
    return json.loads(Path(path).read_text())


def timing(cfg: DictConfig) -> Path:
    """Time methods on a random-weight target of `timing.shape` (see eagle/bench/timing.py), or,
    with `timing.measured`, only add the projection to an earlier timing.json."""
    tcfg = cfg.timing
    for name in tcfg.methods:
        if MethodSpec.parse(name).base not in ("vanilla", "eagle"):
            raise MethodError(f"timing runs vanilla and eagle (with any runner), not {name!r}")
    results = read_json(tcfg.tau_from, "timing.tau_from (a benchmark's results.json)") if tcfg.tau_from else None
    if results is not None and not tcfg.measured and "eagle:static" not in tcfg.methods:
        raise MethodError("a projection (timing.tau_from) needs eagle:static among timing.methods")
    if tcfg.measured:
        report = read_json(tcfg.measured, "timing.measured (a timing.json)")
        report["tau_from"] = str(tcfg.tau_from) if tcfg.tau_from else None
        report["projection"] = project(report["methods"], results) if results is not None else None
        out_dir = write_timing(report, tcfg.out_dir)
        print((out_dir / "timing.md").read_text())
        return out_dir
    shape = OmegaConf.to_container(tcfg.shape, resolve=True)
    dtype = resolve_dtype_name(tcfg.dtype, cfg.device)
    target = random_target(shape, dtype, cfg.device, seed=cfg.seed)
    cfg = OmegaConf.merge(cfg, {"static_max_len": tcfg.max_len, "eagle": {"random": True}})
    methods = Methods(cfg)
    gb = weight_bytes(target) / 1e9
    device_name = torch.cuda.get_device_name(cfg.device) if str(cfg.device).startswith("cuda") else str(cfg.device)
    bandwidth = tcfg.bandwidth_gb_s or gpu_bandwidth_gb_s(device_name)
    if bandwidth is None:
        raise ValueError(f"no nominal memory bandwidth is known for {device_name!r}: give timing.bandwidth_gb_s "
                         "(GB/s) for the floor")
    report = {"kind": "timing", "shape_name": tcfg.shape_name, "shape": shape,
              "params_b": sum(p.numel() for p in target.parameters()) / 1e9, "dtype": dtype,
              "device": device_name,
              "compile_mode": compile_mode(cfg), "tree": cfg.eagle.tree, "prompt_len": tcfg.prompt_len,
              "new_tokens": tcfg.new_tokens, "repeats": tcfg.repeats, "weights_gb": gb,
              "bandwidth_gb_s": bandwidth, "floor_ms_per_token": 1000 * gb / bandwidth,
              "methods": {}, "tau_from": str(tcfg.tau_from) if tcfg.tau_from else None, "projection": None,
              "torch": torch.__version__}
    for name in tcfg.methods:  # the report is rewritten after each method: a killed run keeps what it timed
        method = build_method(name, methods.context(dtype, target=target), methods.sections)
        report["methods"] |= time_methods(target, {name: method}, tcfg.prompt_len, tcfg.new_tokens, tcfg.repeats,
                                          seed=cfg.seed)
        write_timing(report, tcfg.out_dir)
    if results is not None:
        report["projection"] = project(report["methods"], results)
    out_dir = write_timing(report, tcfg.out_dir)
    print((out_dir / "timing.md").read_text())
    return out_dir


def floor(cfg: DictConfig) -> Path:
    """The memory floor of `target`'s step on this machine and its forwards of n new tokens,
    for each runner setting of `floor.settings` (eagle/bench/floor.py)."""
    from eagle.bench import floor as fl

    fcfg = cfg.floor
    settings = {}  # name -> (runner, compiled, kernels): RUNNER[+compile][+KERNELS|+auto]
    named = {*KERNELS, "auto"} - {"default"}
    for setting in fcfg.settings:  # every setting checked before anything is loaded or timed
        kind, *flags = setting.split("+")
        kernels = [f for f in flags if f in named]
        if (kind not in ("dynamic", "static") or not set(flags) <= {"compile", *named}
                or len(set(flags)) < len(flags) or len(kernels) > 1):
            raise ValueError(f"floor.settings: {setting!r} is not RUNNER[+compile][+{'|+'.join(sorted(named))}] "
                             "with RUNNER dynamic or static")
        if "compile" in flags and kind != "static":
            raise ValueError("floor.settings: compile needs the static runner (static+compile)")
        kernel = kernels[0] if kernels else "default"
        settings[setting] = (kind, "compile" in flags, kernel if kernel == "auto" else check_kernels(kernel, cfg.device))
    dtype = resolve_dtype_name(fcfg.dtype, cfg.device, wide=False)
    target, _ = load_target(cfg.target, dtype=resolve_dtype(dtype), device=cfg.device, with_tokenizer=False)
    auto = None  # +auto: the kernels decoding's kernels=auto would choose for this target here (timed once)
    if any(kernels == "auto" for _, _, kernels in settings.values()):
        chosen = choose_kernels(target, "auto", cfg.device, dtype)
        auto = chosen if isinstance(chosen, KernelChoice) else KernelChoice(kernels=chosen, ms={})
        settings = {name: (kind, compiled, auto.kernels if kernels == "auto" else kernels)
                    for name, (kind, compiled, kernels) in settings.items()}
    probe = fl.BandwidthProbe(cfg.device, megabytes=fcfg.buffer_mb)
    bandwidth = probe(5)
    gflops = fl.peak_gflops(cfg.device, size=fcfg.peak_size, dtype=resolve_dtype(dtype))
    report = {"kind": "floor", "target": str(cfg.target), "dtype": dtype, "device": str(cfg.device),
              "threads": torch.get_num_threads(), "context": fcfg.context, "repeats": fcfg.repeats,
              "tokens": list(fcfg.tokens), "bandwidth_gb_s": bandwidth, "weight_bytes": fl.weight_bytes(target),
              "peak_gflops": gflops, "peak_size": fcfg.peak_size, "flops_per_token": fl.linear_flops(target),
              "torch": torch.__version__, "settings": {}}
    if auto is not None:
        report["auto_kernels"] = {"kernels": auto.kernels, "ms": auto.ms}
    if fcfg.product_rows:
        report["products"] = fl.product_costs(target, [int(n) for n in fcfg.product_rows], repeats=fcfg.repeats)
    # the settings take turns forward by forward (fl.settings_costs), on their own kernels: switching
    # keeps every setting's packed weights (release=False), so a turn costs no packing
    turns = {setting: fl.Setting(fl.runner_factory(target, kind, "default" if compiled else None, max_len=fcfg.max_len),
                                 functools.partial(use_kernels, target, kernels, release=False))
             for setting, (kind, compiled, kernels) in settings.items()}
    steps, measured = {}, {}  # setting -> its 1-token step of one sequence; name -> (costs, batch, setting)
    for batch in sorted({1, *(int(b) for b in fcfg.batch_sizes)}):  # a batch's forwards: B x n tokens
        costs = fl.settings_costs(target, turns, fcfg.tokens, fcfg.context, fcfg.repeats, seed=cfg.seed, batch=batch,
                                  probe=probe if fcfg.paired else None)
        for setting, by_size in costs.items():
            name = setting if batch == 1 else f"{setting} x{batch}"
            steps.setdefault(setting, by_size[1].ms if 1 in by_size else None)
            measured[name] = (by_size, batch, setting)
            print(f"[floor] {name}: " + ", ".join(
                f"{n} tokens {c.ms:.1f} ms" + (f" ({c.paired_floors:.2f} floors, paired)" if c.paired_floors else "")
                for n, c in by_size.items()))
    # the floor is the fastest read of the memory: the first probe, or a faster one paired with a
    # forward (the memory changes phase: a first probe in a slow one put steps at 0.89 "floors")
    reads = [gb for by_size, _, _ in measured.values() for c in by_size.values() for gb in c.bandwidth_gb_s]
    report["first_probe_gb_s"], bandwidth = bandwidth, max([bandwidth, *reads])
    report["bandwidth_gb_s"], report["floor_ms"] = bandwidth, report["weight_bytes"] / (bandwidth * 1e9) * 1e3
    for name, (by_size, batch, setting) in measured.items():
        report["settings"][name] = fl.floor_report(target, bandwidth, by_size, steps[setting], batch, gflops)
    use_kernels(target, "default")  # frees what the settings packed
    return write_report(fcfg.out_dir, "floor", report, fl.markdown(report))


def export(cfg: DictConfig) -> Path:
    """Write the drafter `eagle.drafter` (checked against `target`) in each of `export.formats`,
    one folder each; a format named there that cannot hold it is named with the reason, after
    the others. `export.formats=null` writes every format that can hold it and says why it
    skips the others. Only the target's embeddings and LM head are read (the export's
    embedding table and logit transform): a 70B target is not loaded whole for it."""
    from eagle.models.checkpoint import load_drafter
    from eagle.models.export import FORMATS, ExportError, export_drafter

    target, tokenizer = load_target(cfg.target, weights="head")
    drafter = load_drafter(cfg.eagle.drafter, target, tokenizer, str(cfg.target), dtype=cfg.export.dtype)
    asked = cfg.export.formats
    out, refused = Path(cfg.export.out_dir), []
    for fmt in FORMATS if asked is None else asked:
        try:
            print(f"[export] {fmt}: {export_drafter(drafter, out / fmt, fmt)}")
        except ExportError as err:
            if asked is None:
                print(f"[export] {fmt}: skipped: {err}")
            else:
                refused.append(f"{fmt}: {err}")
    if refused:
        raise ExportError("; ".join(refused))
    return out


def write_report(out_dir: str | Path, name: str, report: dict, markdown: str) -> Path:
    """`<name>.json` and `<name>.md` in `out_dir`; the Markdown is printed too."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
    return out


def coverage(cfg: DictConfig) -> Path:
    """SpecInfer's boost-tuning report: each SSM's coverage of the held-out self-distilled rows,
    the union of the boost-tuned SSMs (`specinfer.models`) and the baseline (`coverage.baseline`:
    one SSM trained on all rows for the same budget). Writes coverage.json and coverage.md."""
    from eagle.data.coverage import CoverCriterion, agreement, coverage_markdown, coverage_report
    from eagle.data.distill import load_distilled, split_rows

    ccfg = cfg.coverage
    _, splits = load_distilled(ccfg.distill_dir)
    ids, argmax, prompt_len = split_rows(splits["validation"], f"{ccfg.distill_dir} validation")
    boosted = {f"ssm_{k + 1}": str(p) for k, p in enumerate(cfg.specinfer.models)}
    baseline = f"baseline ({Path(str(ccfg.baseline)).parent.name})" if ccfg.baseline else None
    models = {**boosted, **({baseline: str(ccfg.baseline)} if baseline else {}),
              **{Path(str(p)).parent.name: str(p) for p in ccfg.also}}
    agree = {}
    for name, path in tqdm(models.items(), desc="coverage", unit="model"):
        model, _ = load_target(path, dtype=torch.float32, device=cfg.device, with_tokenizer=False)
        agree[name] = agreement(model, ids, argmax, prompt_len)
    report = coverage_report(agree, list(boosted), baseline, CoverCriterion(ccfg.threshold))
    report["paths"] = models
    return write_report(ccfg.out_dir, "coverage", report, coverage_markdown(report))


def profile(cfg: DictConfig) -> Path:
    """Where EAGLE's round goes (`eagle.bench.profile`): drafting and verification split into
    their parts, per round and per drafter pass, next to a vanilla step of the same target.
    Writes profile.json and profile.md."""
    import eagle.decoding.engine as engine
    from eagle.bench.profile import Timers, breakdown_markdown, round_breakdown, timed
    from eagle.decoding.stats import DecodeStats
    from eagle.proposers.template import TemplateProposer

    pcfg = cfg.profile
    methods = Methods(cfg)
    dtype = methods.dtype("eagle", {} if pcfg.dtype == "auto" else {"eagle": pcfg.dtype})
    _, tokenizer = methods.target(dtype)
    eagle = methods.build("eagle", dtype)
    # vanilla in EAGLE's dtype (the parts' yardstick) and, on a CPU, in fp32 too: EAGLE's speedup is
    # also reported against the faster one (a bf16 one-token step can be the slower there, LOG.md)
    cpu = torch.device(cfg.device).type == "cpu"
    vanillas = {d: methods.build("vanilla", d) for d in dict.fromkeys((dtype, "float32") if cpu else (dtype,))}
    prompts = [encode_prompt(tokenizer, p) for p in load_eval_set(pcfg.eval_set, pcfg.num_prompts)]
    policy = SamplingPolicy(temperature=pcfg.temperature)
    model = eagle.proposer.model
    if compile_mode(cfg):  # time whole compiled passes: a timer inside one would break its graph
        inside = [(model, "_scores", "drafter: FC + decoder layer"), (model, "_scores_fixed", "drafter: FC + decoder layer")]
    else:
        inside = [(model.drafter, "forward", "drafter: FC + decoder layer"),
                  (model.cache, "prepare", "drafter: mask + positions")]
    patches = [
        *inside, (model.drafter, "logits", "drafter: LM head"), (eagle.proposer, "_choose", "children: top-k / sampling"),
        (model.cache, "keep", "drafter: cache ops"), (model.cache, "reserve", "drafter: cache ops"),
        (eagle.runner, "verify", "target: tree forward"), (SamplingPolicy, "probs", "target: logits processing"),
        (engine, "verify_tree_greedy", "acceptance"), (engine, "verify_tree_stochastic", "acceptance"),
        (eagle.runner, "commit", "target: KV compaction")]
    if not isinstance(eagle.proposer, TemplateProposer):
        raise ValueError("profile: the eagle method must be a template proposer")

    def decode_all(runs: dict) -> dict[str, DecodeStats]:
        """Every prompt with each method, in turns prompt by prompt (a drift of the machine's
        load reaches them alike)."""
        out = {name: DecodeStats(prompt_len=0) for name in runs}
        for ids in tqdm(prompts, desc=f"profile: {', '.join(runs)}", unit="prompt"):
            for name, method in runs.items():
                out[name].rounds += method.generate(ids, pcfg.new_tokens, policy,
                                                    seeded_generator(cfg.seed, cfg.device)).stats.rounds
        return out

    for method in (*vanillas.values(), eagle):
        warm_up(method, prompts, pcfg.new_tokens, policy, seeded_generator(cfg.seed, cfg.device))
    # the speedups: EAGLE without timers (on a GPU each one synchronises) against vanilla
    plain = decode_all({**{f"vanilla ({d})": v for d, v in vanillas.items()}, "eagle": eagle})
    bare = plain.pop("eagle")
    plain = {d: plain[f"vanilla ({d})"] for d in vanillas}
    # the breakdown: the same decodes again, every part timed
    timers = Timers(cuda=str(cfg.device).startswith("cuda"))
    with timed(patches, timers):
        spec = decode_all({"eagle (timed)": eagle})["eagle (timed)"]
    passes = timers.calls.get("drafter: FC + decoder layer", 0)  # (compiled: mask building included)
    breakdown = round_breakdown(timers, len(spec.rounds), spec.draft_s, spec.verify_s, passes)
    breakdown["tau"] = spec.tau
    steps = {d: 1000 * (p.draft_s + p.verify_s) / len(p.rounds) for d, p in plain.items()}  # ms per token
    step_ms, fastest = steps[dtype], min(steps, key=steps.get)
    untimed_round_ms = 1000 * (bare.draft_s + bare.verify_s) / len(bare.rounds)
    breakdown["untimed_round_ms"] = untimed_round_ms  # the timers' own cost is round_ms - this
    per_token = {"vanilla": step_ms, "eagle": untimed_round_ms / bare.tau}
    report = {"method": "eagle", "dtype": dtype, "device": str(cfg.device), "threads": torch.get_num_threads(),
              "prompts": len(prompts), "new_tokens": pcfg.new_tokens, "temperature": pcfg.temperature,
              "tree": cfg.eagle.tree, "tree_nodes": eagle.proposer.max_nodes,
              "target_layers": int(methods.target(dtype)[0].config.num_hidden_layers),
              "vanilla": {"step_ms": step_ms}, "vanilla_by_dtype": {d: {"step_ms": ms} for d, ms in steps.items()},
              "eagle": breakdown, "speedup": per_token["vanilla"] / per_token["eagle"],
              "fastest_vanilla": fastest, "speedup_vs_fastest": steps[fastest] / per_token["eagle"]}
    return write_report(pcfg.out_dir, "profile", report, breakdown_markdown(report))


def ablations(cfg: DictConfig) -> Path:
    """Benchmark every ablation drafter under `ablations.dir` against vanilla in one run, then
    write the ablation table (eagle/bench/ablations.py) beside the benchmark's own report."""
    from eagle.bench import ablations as abl

    acfg = cfg.ablations
    variants = abl.find_variants(acfg.dir)
    labels = {v.name: f"eagle[{v.name}]" for v in variants}
    drafters = {labels[v.name]: str(v.drafter) for v in variants}
    methods = Methods(cfg)
    dtype = methods.dtype("eagle", {"eagle": acfg.dtype} if acfg.dtype else {})

    def build(label: str):
        if label == "vanilla":
            return methods.build("vanilla", dtype), dtype
        sections = {**methods.sections, "eagle": {**methods.sections["eagle"], "drafter": drafters[label]}}
        method = build_method("eagle", methods.context(dtype), sections)
        method.name = label
        return method, dtype

    eval_sets = {Path(name).stem: load_eval_set(name, acfg.num_prompts) for name in acfg.eval_sets}
    _, tokenizer = methods.target(dtype)
    config = BenchmarkConfig(methods=("vanilla", *drafters), temperatures=tuple(acfg.temperatures),
                             max_new_tokens=cfg.max_new_tokens, warmup=cfg.benchmark.warmup,
                             warmup_tokens=cfg.benchmark.warmup_tokens, top_k=cfg.top_k, top_p=cfg.top_p,
                             seed=cfg.seed)
    out_dir = Path(acfg.out_dir)
    keep_previous(out_dir, ("ablations.json", "ablations.md", "ablations.png"))  # the table of a run before
    bench = run_benchmark(eval_sets, tokenizer, build, config, target_name=str(cfg.target), out_dir=out_dir / "bench",
                          device=cfg.device, reference=lambda d: methods.build("vanilla", d))
    report = abl.ablation_report(variants, bench, labels)
    abl.write(report, out_dir)
    print((out_dir / "ablations.md").read_text())
    return out_dir


def batch(cfg: DictConfig) -> Path:
    """Every method of `batch.methods` at every batch size of `batch.sizes`, against vanilla at the
    same size, on `batch.num_prompts` prompts of each of `batch.eval_sets` (eagle/bench/batch.py)."""
    from eagle.bench.batch import BatchConfig, run_batch_benchmark

    bc = cfg.batch
    config = BatchConfig(sizes=tuple(int(b) for b in bc.sizes), methods=tuple(bc.methods),
                         temperatures=tuple(bc.temperatures), max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k,
                         top_p=cfg.top_p, seed=cfg.seed)  # a bad size or a missing vanilla fails before loading
    for name in config.methods:
        MethodSpec.parse(name.replace("{B}", "1"))
    methods = Methods(cfg)
    dtypes = dtype_overrides(bc.dtypes)
    _, tokenizer = methods.target(methods.dtype("vanilla", dtypes))
    eval_sets = {name: load_eval_set(name, bc.num_prompts) for name in bc.eval_sets}
    prompts = [encode_prompt(tokenizer, p) for every in eval_sets.values() for p in every]

    def build(name: str):
        dtype = methods.dtype(name, dtypes)
        return methods.build(name, dtype), dtype

    out_dir = Path(bc.out_dir)
    labels = list(dict.fromkeys(m.replace("{B}", str(b)) for m in config.methods for b in config.sizes))
    key = resume_key(cfg, labels, config.temperatures, dtypes, (), eval_sets, section="batch") if bc.resume else None
    run_batch_benchmark(prompts, build, config, target_name=str(cfg.target), out_dir=out_dir, device=cfg.device,
                        resume_key=key)
    print((out_dir / "batch.md").read_text())
    return out_dir


def decode(cfg: DictConfig):
    set_threads(cfg.threads)
    if cfg.mode == "generate":
        return generate(cfg)
    modes = {"benchmark": benchmark, "tree_search": tree_search, "timing": timing, "export": export,
             "coverage": coverage, "profile": profile, "ablations": ablations, "floor": floor, "batch": batch}
    if cfg.mode in modes:
        out_dir = modes[cfg.mode](cfg)
        print(out_dir.resolve())
        return out_dir
    raise ValueError(f"unknown mode {cfg.mode!r}: use generate, {', '.join(modes)}")


@hydra.main(config_path="configs", config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    decode(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)

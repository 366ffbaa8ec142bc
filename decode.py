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

Each mode here turns its config section into library calls: the methods a mode compares are
eagle/bench/builder.py's `Methods` (`methods_of` builds them from the config), the tree search
runs in eagle/bench/machine_tree.py, and each measurement in its own module of eagle/bench/
(benchmark, floor, profile, ablations, batch, timing).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import platform
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from eagle.artifacts import files_stamp, keep_previous
from eagle.bench.benchmark import BenchmarkConfig, encode_prompt, run_benchmark
from eagle.bench.builder import Methods, choose_kernels
from eagle.bench.evalsets import Prompt, load_eval_set
from eagle.bench.floor import weight_bytes
from eagle.bench.machine_tree import TreeSearchConfig, search_tree
from eagle.bench.methods import SECTIONS, MethodError, MethodSpec, build_method
from eagle.bench.precision import KernelChoice
from eagle.bench.timing import project, random_target, time_methods, write_timing
from eagle.cli import refuse_added_settings, run_cli
from eagle.hardware import check_device, gpu_bandwidth_gb_s, resolve_dtype_name, set_threads
from eagle.sampling import SamplingPolicy, seeded_generator
from eagle.target import load_target, resolve_dtype
from eagle.tree import TreeError, resolve_tree

ROOT = Path(__file__).resolve().parent
TREE_DIR = ROOT / "configs" / "tree"


def compile_mode(cfg: DictConfig) -> str | None:
    """`compile=true`: CUDA graphs on a GPU (the per-token launch overhead is what they remove),
    plain inductor code elsewhere."""
    if not cfg.compile:
        return None
    return "reduce-overhead" if str(cfg.device).startswith("cuda") else "default"


def methods_of(cfg: DictConfig) -> Methods:
    """The config's methods (eagle.bench.builder.Methods): its method sections and settings."""
    return Methods({name: OmegaConf.to_container(cfg[name], resolve=True) for name in SECTIONS}, target=cfg.target,
                   device=cfg.device, tree_dir=TREE_DIR, kernels=cfg.kernels, runner=cfg.runner,
                   static_max_len=cfg.static_max_len, compile_mode=compile_mode(cfg))


def generate(cfg: DictConfig) -> None:
    policy = SamplingPolicy(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)  # a typo fails before loading
    methods = methods_of(cfg)
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
    methods = methods or methods_of(cfg)
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
    key = (resume_key(cfg, names, config.temperatures, dtypes, methods.tree_dirs(tree_dirs), eval_sets)
           if bcfg.resume else None)
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
    eagle.bench.batch.run_batch_benchmark, `names` with each batch size's tree filled in).
    `tree_dirs`: where the methods' tree names are looked up (`Methods.tree_dirs`)."""
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
            trees[name] = list(resolve_tree(tree, tree_dirs).parents) if tree else None
        except (TreeError, OSError):
            trees[name] = None  # building the method says what is wrong with it
    return {"settings": settings, "benchmark": bench, "methods": list(names), "trees": trees,
            "temperatures": [float(t) for t in temperatures], "dtypes": dict(dtypes), "tree_dirs": list(tree_dirs),
            "prompts": {k: [[p.id, p.chat, hashlib.sha256(p.text.encode()).hexdigest()[:16]] for p in v]
                        for k, v in eval_sets.items()}, "inputs": files_stamp(files),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform()}


def tree_search(cfg: DictConfig) -> Path:
    """The tree for this machine (eagle.bench.machine_tree.search_tree), its candidates compared
    in a benchmark of this config."""
    bcfg = cfg.benchmark
    section = OmegaConf.to_container(cfg.tree_search, resolve=True)
    run = {"eval_sets": list(bcfg.eval_sets), "benchmark_prompts": bcfg.num_prompts, "dtypes": dtype_overrides(bcfg.dtypes),
           "max_new_tokens": cfg.max_new_tokens, "warmup_tokens": bcfg.warmup_tokens, "seed": cfg.seed}
    own = [f.name for f in dataclasses.fields(TreeSearchConfig) if f.name not in run]  # the section's settings
    if unknown := sorted(set(section) - set(own)):
        raise ValueError(f"tree_search: unknown setting(s) {', '.join(unknown)} (it has {', '.join(own)})")
    if missing := [k for k in own if k not in section]:
        raise ValueError(f"tree_search: {', '.join(missing)} missing (configs/decode.yaml's section sets each one)")
    methods = methods_of(cfg)
    return search_tree(methods, TreeSearchConfig(**section, **run), compare=functools.partial(benchmark, cfg, methods))


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
    methods = methods_of(cfg)
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
    for each runner setting of `floor.settings` (eagle.bench.floor.measure_floor)."""
    from eagle.bench import floor as fl

    fcfg = cfg.floor
    settings = fl.parse_settings(fcfg.settings, cfg.device)  # every setting checked before anything is loaded
    dtype = resolve_dtype_name(fcfg.dtype, cfg.device, wide=False)
    target, _ = load_target(cfg.target, dtype=resolve_dtype(dtype), device=cfg.device, with_tokenizer=False)
    auto = None  # +auto: the kernels decoding's kernels=auto would choose for this target here (timed once)
    if any(kernels == "auto" for _, _, kernels in settings.values()):
        chosen = choose_kernels(target, "auto", cfg.device, dtype)
        auto = chosen if isinstance(chosen, KernelChoice) else KernelChoice(kernels=chosen, ms={})
    report = fl.measure_floor(target, settings, tokens=list(fcfg.tokens), context=fcfg.context, repeats=fcfg.repeats,
                              device=cfg.device, batch_sizes=[int(b) for b in fcfg.batch_sizes], paired=fcfg.paired,
                              max_len=fcfg.max_len, buffer_mb=fcfg.buffer_mb, peak_size=fcfg.peak_size,
                              product_rows=[int(n) for n in fcfg.product_rows or []], seed=cfg.seed, auto=auto)
    report = {"kind": "floor", "target": str(cfg.target), "dtype": dtype, **report}
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
    """Where EAGLE's round goes (`eagle.bench.profile.profile_round`): drafting and verification
    split into their parts, per round and per drafter pass, next to a vanilla step of the same
    target. Writes profile.json and profile.md."""
    from eagle.bench.profile import breakdown_markdown, profile_round

    pcfg = cfg.profile
    methods = methods_of(cfg)
    dtype = methods.dtype("eagle", {} if pcfg.dtype == "auto" else {"eagle": pcfg.dtype})
    _, tokenizer = methods.target(dtype)
    eagle = methods.build("eagle", dtype)
    # vanilla in EAGLE's dtype (the parts' yardstick) and, on a CPU, in fp32 too: EAGLE's speedup is
    # also reported against the faster one (a bf16 one-token step can be the slower there, LOG.md)
    cpu = torch.device(cfg.device).type == "cpu"
    vanillas = {d: methods.build("vanilla", d) for d in dict.fromkeys((dtype, "float32") if cpu else (dtype,))}
    prompts = [encode_prompt(tokenizer, p) for p in load_eval_set(pcfg.eval_set, pcfg.num_prompts)]
    figures = profile_round(eagle, dtype, vanillas, prompts, pcfg.new_tokens, SamplingPolicy(temperature=pcfg.temperature),
                            seed=cfg.seed, device=cfg.device, compiled=bool(compile_mode(cfg)))
    report = {"method": "eagle", "dtype": dtype, "device": str(cfg.device), "threads": torch.get_num_threads(),
              "prompts": len(prompts), "new_tokens": pcfg.new_tokens, "temperature": pcfg.temperature,
              "tree": cfg.eagle.tree, "tree_nodes": eagle.proposer.max_nodes,
              "target_layers": int(methods.target(dtype)[0].config.num_hidden_layers), **figures}
    return write_report(pcfg.out_dir, "profile", report, breakdown_markdown(report))


def ablations(cfg: DictConfig) -> Path:
    """Benchmark every ablation drafter under `ablations.dir` against vanilla in one run, then
    write the ablation table (eagle/bench/ablations.py) beside the benchmark's own report
    (`ablations.rebuild`: the table again from that finished benchmark, decoding nothing)."""
    from eagle.bench import ablations as abl

    acfg = cfg.ablations
    variants = abl.find_variants(acfg.dir)
    labels = {v.name: f"eagle[{v.name}]" for v in variants}
    out_dir = Path(acfg.out_dir)
    if acfg.rebuild:
        bench, variants = abl.finished_bench(out_dir / "bench", variants, labels)
    else:
        bench = benchmark_ablations(cfg, {labels[v.name]: str(v.drafter) for v in variants}, out_dir / "bench")
    report = abl.ablation_report(variants, bench, labels)
    keep_previous(out_dir, ("ablations.json", "ablations.md", "ablations.png"))  # the table of a run before
    abl.write(report, out_dir)
    print((out_dir / "ablations.md").read_text())
    return out_dir


def benchmark_ablations(cfg: DictConfig, drafters: dict[str, str], out_dir: Path) -> dict:
    """Vanilla and EAGLE with each drafter of `drafters` (label -> path), in one benchmark run."""
    from eagle.bench import ablations as abl

    acfg = cfg.ablations
    methods = methods_of(cfg)
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
    abl.record_drafters(out_dir, drafters)  # what a rebuild checks the drafters against
    config = BenchmarkConfig(methods=("vanilla", *drafters), temperatures=tuple(acfg.temperatures),
                             max_new_tokens=cfg.max_new_tokens, warmup=cfg.benchmark.warmup,
                             warmup_tokens=cfg.benchmark.warmup_tokens, top_k=cfg.top_k, top_p=cfg.top_p,
                             seed=cfg.seed)
    return run_benchmark(eval_sets, tokenizer, build, config, target_name=str(cfg.target), out_dir=out_dir,
                         device=cfg.device, reference=lambda d: methods.build("vanilla", d))


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
    methods = methods_of(cfg)
    dtypes = dtype_overrides(bc.dtypes)
    _, tokenizer = methods.target(methods.dtype("vanilla", dtypes))
    eval_sets = {name: load_eval_set(name, bc.num_prompts) for name in bc.eval_sets}
    prompts = [encode_prompt(tokenizer, p) for every in eval_sets.values() for p in every]

    def build(name: str):
        dtype = methods.dtype(name, dtypes)
        return methods.build(name, dtype), dtype

    out_dir = Path(bc.out_dir)
    labels = list(dict.fromkeys(m.replace("{B}", str(b)) for m in config.methods for b in config.sizes))
    key = (resume_key(cfg, labels, config.temperatures, dtypes, methods.tree_dirs(), eval_sets, section="batch")
           if bc.resume else None)
    run_batch_benchmark(prompts, build, config, target_name=str(cfg.target), out_dir=out_dir, device=cfg.device,
                        resume_key=key)
    print((out_dir / "batch.md").read_text())
    return out_dir


def decode(cfg: DictConfig):
    check_device(cfg.device)
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
    refuse_added_settings(HydraConfig.get(), hydra.compose)
    decode(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)

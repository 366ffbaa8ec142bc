"""The memory-floor benchmark (eagle/bench/floor.py, decode.py mode=floor): what it counts and
what it times, on tiny models. Its figures are measurements: no test asserts a speed."""

from __future__ import annotations

import json

import pytest
import torch

from eagle.bench import builder
from eagle.bench import floor as fl
from eagle.decoding.backend import kernels_of
from eagle.decoding.runners import DynamicRunner, StaticRunner
from eagle.kernels import use_kernels
from eagle.tree import Tree
from helpers.configs import compose_config
from helpers.models import make_tiny_model


def test_weight_bytes_count_a_tied_head_once():
    tied = make_tiny_model("llama", tie_word_embeddings=True)
    untied = make_tiny_model("llama", tie_word_embeddings=False)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    head = tied.lm_head.weight.numel() * 4
    fp32 = fl.weight_bytes(tied)
    assert fp32 == sum(
        p.numel() * 4 for p in tied.parameters()
    )  # the table is the head: read whole
    # untied, a step reads the head whole and one row of the table (it once counted the whole
    # table, overstating the step of a small untied model)
    assert (
        fl.weight_bytes(untied) == sum(p.numel() * 4 for p in untied.parameters()) - head + 32 * 4
    )
    assert fl.weight_bytes(untied) - fp32 == 32 * 4
    assert fl.weight_bytes(tied.to(torch.bfloat16)) * 2 == fp32


@pytest.mark.parametrize("n", [1, 2, 3, 8, 26])
def test_the_timed_forwards_verify_trees_of_n_nodes(n):
    parents = fl.binary_tree(n)
    tree = Tree.of(parents)
    assert len(tree.parents) == n and tree.is_chain == (n <= 2)


class Recording(DynamicRunner):
    """A dynamic runner that records the size of every verification and commit."""

    def __init__(self, target, log):
        super().__init__(target)
        self.log = log

    def verify(self, tokens, parents):
        self.log.append(("verify", tokens.shape[1], *map(len, parents)))
        return super().verify(tokens, parents)

    def commit(self, paths):
        self.log.append(("commit", *map(tuple, paths)))
        super().commit(paths)


def test_forward_costs_time_one_forward_of_n_tokens_per_repeat():
    target = make_tiny_model("llama")
    log, runners = [], []

    def make(n):
        runners.append(Recording(target, log))
        return runners[-1]

    costs = fl.forward_costs(target, tokens=(1, 4, 9), context=10, repeats=3, make=make)
    assert list(costs) == [1, 4, 9] and all(
        c.ms > 0 and len(c.times_ms) == 3 for c in costs.values()
    )
    assert all(
        c.paired_floors is None and c.bandwidth_gb_s == [] for c in costs.values()
    )  # no probe
    verifies = [entry[1:] for entry in log if entry[0] == "verify"]
    # a warm-up of each size, then the sizes in turn, one forward each per repeat
    assert verifies == [(1, 1), (4, 4), (9, 9)] * 4
    assert all(entry == ("commit", (0,)) for entry in log if entry[0] == "commit")  # the root only
    assert [r.length for r in runners] == [10 + 4] * 3  # each size on its own prefilled runner


def test_a_static_runner_is_sized_for_each_forward():
    target = make_tiny_model("llama")
    make = fl.runner_factory(target, "static", max_len=64)
    runner = make(8)
    assert isinstance(runner, StaticRunner) and runner.width == 8 and runner.capacity == 0
    assert fl.forward_costs(target, tokens=(8,), context=10, repeats=2, make=make)[8].ms > 0
    assert isinstance(fl.runner_factory(target)(3), DynamicRunner)


def test_settings_take_turns_each_on_its_own_kernels():
    target = make_tiny_model("llama")
    log = []

    class Timed(DynamicRunner):
        def verify(self, tokens, parents):
            log.append(("forward", kernels_of(target), tokens.shape[1]))
            return super().verify(tokens, parents)

    settings = {
        name: fl.Setting(
            lambda n: Timed(target), lambda k=kernels: use_kernels(target, k, release=False)
        )
        for name, kernels in (("plain", "default"), ("packed", "onednn"))
    }
    costs = fl.settings_costs(target, settings, tokens=(1, 3), context=6, repeats=2)
    turn = [
        ("forward", "default", 1),
        ("forward", "default", 3),
        ("forward", "onednn", 1),
        ("forward", "onednn", 3),
    ]
    assert (
        log == turn * 3
    )  # the warm-ups, then two repeats: one forward of each setting and size per turn
    assert set(costs) == {"plain", "packed"} and all(
        len(c.times_ms) == 2 for by in costs.values() for c in by.values()
    )


def test_a_probe_before_each_forward_pairs_it_with_the_floor_of_its_moment():
    target = make_tiny_model("llama")
    nbytes = fl.weight_bytes(target)
    readings = iter(
        [10.0, 5.0, 20.0, 5.0, 40.0, 5.0]
    )  # GB/s: the sizes take turns, repeat by repeat
    log = []

    class Timed(DynamicRunner):  # records when each forward runs against the probe's reads
        def verify(self, tokens, parents):
            log.append("forward")
            return super().verify(tokens, parents)

    def probe():
        log.append("probe")
        return next(readings)

    costs = fl.forward_costs(
        target, tokens=(1, 3), context=6, repeats=3, make=lambda n: Timed(target), probe=probe
    )
    assert (
        log == ["forward"] * 2 + ["probe", "forward"] * 6
    )  # none before the warm-ups, one before each timed
    first = costs[1]
    assert first.bandwidth_gb_s == [10.0, 20.0, 40.0]
    floors = [
        nbytes / (gb * 1e9) * 1e3 for gb in first.bandwidth_gb_s
    ]  # ms of each forward's floor
    assert first.paired_floors == pytest.approx(
        sorted(t / f for t, f in zip(first.times_ms, floors))[1]
    )
    assert costs[3].paired_floors == pytest.approx(
        costs[3].ms * 5.0 * 1e6 / nbytes
    )  # one bandwidth: median / floor
    report = fl.floor_report(target, 5.0, costs)
    assert [r["paired_floors"] for r in report["forwards"]] == [
        first.paired_floors,
        costs[3].paired_floors,
    ]
    table = fl.markdown(
        {
            "target": "t",
            "dtype": "float32",
            "threads": 1,
            "device": "cpu",
            "weight_bytes": nbytes,
            "bandwidth_gb_s": 5.0,
            "floor_ms": report["floor_ms"],
            "flops_per_token": 1,
            "peak_gflops": 1.0,
            "peak_size": 8,
            "context": 6,
            "repeats": 3,
            "tokens": [1, 3],
            "settings": {"dynamic": report},
        }
    )
    assert (
        "dynamic: ms | floors | paired | roofs | steps" in table
        and "6 reads, 5.0-40.0 GB/s, median 7.5" in table
    )
    assert f"| {first.paired_floors:.2f} |" in table.split("| 1 |")[1].split("\n")[0]


def test_the_probe_reads_its_buffer_and_reports_a_rate():
    probe = fl.BandwidthProbe(megabytes=8, repeats=2)
    assert probe.buffer.numel() == 2 * 2**20 and probe() > 0 and probe(1) > 0


def test_the_report_counts_forwards_in_floors_and_steps():
    target = make_tiny_model("llama")
    nbytes = fl.weight_bytes(target)
    costs = {1: fl.ForwardCost(4.0), 8: fl.ForwardCost(6.0)}
    report = fl.floor_report(target, bandwidth_gb_s=nbytes / 1e9 / 2e-3, costs=costs)  # floor: 2 ms
    assert report["floor_ms"] == pytest.approx(2.0)
    assert [(r["tokens"], r["floors"], r["steps"]) for r in report["forwards"]] == [
        (1, pytest.approx(2.0), pytest.approx(1.0)),
        (8, pytest.approx(3.0), pytest.approx(1.5)),
    ]
    assert all(
        r["roof_ms"] == pytest.approx(2.0) for r in report["forwards"]
    )  # no peak rate: the roof is the floor
    flops = fl.linear_flops(target)
    assert flops == 2 * sum(
        m.weight.numel() for m in target.modules() if isinstance(m, torch.nn.Linear)
    )
    # at a peak rate where one token's arithmetic takes 0.5 ms, 8 tokens take 4 ms: above the 2 ms
    # floor
    fast = fl.floor_report(target, nbytes / 1e9 / 2e-3, costs, gflops=flops / 1e9 / 0.5e-3)
    assert [r["roof_ms"] for r in fast["forwards"]] == [pytest.approx(2.0), pytest.approx(4.0)]
    assert fast["forwards"][1]["roofs"] == pytest.approx(1.5)


def test_peak_rate_is_positive():
    assert fl.peak_gflops(size=64, repeats=2) > 0


def test_products_are_timed_per_shape_and_kernel_and_leave_the_kernels():
    target = make_tiny_model(
        "llama"
    )  # q/o 32 x 32, k/v 16 x 32, gate/up 64 x 32, down 32 x 64, head 96 x 32
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU]
    ) as prof:  # the packed kernel must be what is timed
        costs = fl.product_costs(target, rows=(1, 3), repeats=1, kernels=("default", "onednn"))
    assert any(e.key == "mkldnn::_linear_pointwise" for e in prof.key_averages()), (
        "onednn timed F.linear"
    )
    shapes = {
        k: {tuple(c["shape"]): c["products"] for c in costs if c["kernels"] == k}
        for k in ("default", "onednn")
    }
    assert shapes["default"] == {(32, 32): 4, (16, 32): 4, (64, 32): 4, (32, 64): 2, (96, 32): 1}
    # on oneDNN q/k/v (64 x 32 stacked) and gate/up (128 x 32) share one product each
    assert shapes["onednn"] == {(64, 32): 2, (32, 32): 2, (128, 32): 2, (32, 64): 2, (96, 32): 1}
    assert len(costs) == (5 + 5) * 2 and all(c["ms"] > 0 and c["gb_s"] > 0 for c in costs)
    assert kernels_of(target) == "default"
    table = fl.products_markdown(costs)
    assert "| 96 x 32 | 1 | 3 |" in table and "onednn: ms (GB/s)" in table
    assert "| 16 x 32 | 4 | 1 | " in table and table.split("| 16 x 32 | 4 | 1 | ")[1].split("\n")[
        0
    ].endswith("| - |")


def test_bandwidth_is_a_positive_rate():
    assert fl.read_bandwidth(megabytes=8, repeats=2) > 0


def test_floor_mode_writes_its_report(target_dir, tmp_path, monkeypatch):
    from decode import decode

    out = tmp_path / "floor"
    cfg = compose_config(
        "decode",
        [
            f"target={target_dir}",
            "mode=floor",
            "floor.tokens=[1,3]",
            "floor.context=8",
            "floor.repeats=2",
            "floor.buffer_mb=8",
            "floor.peak_size=64",
            "floor.product_rows=[1,2]",
            "floor.settings=[dynamic,static+onednn]",
            "floor.batch_sizes=[3]",
            f"floor.out_dir={out}",
        ],
    )
    decode(cfg)
    report = json.loads((out / "floor.json").read_text())
    assert set(report["settings"]) == {"dynamic", "static+onednn", "dynamic x3", "static+onednn x3"}
    rows = [r for setting in report["settings"].values() for r in setting["forwards"]]
    assert all(
        r["paired_floors"] > 0 and len(r["probe_gb_s"]) == 2 for r in rows
    )  # floor.paired: on by default
    assert "paired" in (out / "floor.md").read_text()
    assert report["dtype"] == "float32"
    assert report["floor_ms"] == pytest.approx(
        report["weight_bytes"] / report["bandwidth_gb_s"] / 1e6
    )
    # the floor is the fastest read of the run, the first probe's or a paired one's
    assert report["bandwidth_gb_s"] == max(
        [report["first_probe_gb_s"], *(gb for r in rows for gb in r["probe_gb_s"])]
    )
    assert all(r["floors"] == pytest.approx(r["ms"] / report["floor_ms"]) for r in rows)
    for setting in report["settings"].values():
        assert [r["tokens"] for r in setting["forwards"]] == [1, 3]
    for kind in (
        "dynamic",
        "static+onednn",
    ):  # 3 sequences' forwards in steps of one sequence's 1-token step
        one, three = (
            report["settings"][kind]["forwards"],
            report["settings"][f"{kind} x3"]["forwards"],
        )
        assert three[0]["steps"] == pytest.approx(three[0]["ms"] / one[0]["ms"])
        assert report["settings"][f"{kind} x3"]["batch"] == 3
    assert "| 3 |" in (out / "floor.md").read_text() and "x3" in (out / "floor.md").read_text()
    assert report["peak_gflops"] > 0 and "roof ms" in (out / "floor.md").read_text()
    assert {c["rows"] for c in report["products"]} == {1, 2} and "products a step | rows" in (
        out / "floor.md"
    ).read_text()
    import eagle.target

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the settings were checked")

    monkeypatch.setattr(eagle.target, "load_target", no_load)
    for bad in (
        "dynamic+compile",
        "static+fast",
        "static+onednn+onednn",
        "onednn",
        "dynamic+fused+fused_prefetch",
        "dynamic+default",
    ):  # refused before anything is loaded or timed
        with pytest.raises(ValueError, match="floor.settings"):
            decode(
                compose_config(
                    "decode",
                    [
                        f"target={target_dir}",
                        "mode=floor",
                        "floor.tokens=[1]",
                        "floor.buffer_mb=8",
                        f"floor.settings=[dynamic,{bad}]",
                        f"floor.out_dir={tmp_path / 'bad'}",
                    ],
                )
            )
    with pytest.raises(
        ValueError, match="floor.settings"
    ):  # one kernel setting per name, auto included
        decode(
            compose_config(
                "decode",
                [
                    f"target={target_dir}",
                    "mode=floor",
                    "floor.tokens=[1]",
                    "floor.buffer_mb=8",
                    "floor.settings=[dynamic+auto+onednn]",
                    f"floor.out_dir={tmp_path / 'bad'}",
                ],
            )
        )


def test_auto_runs_on_the_kernels_decoding_would_choose(target_dir, tmp_path, monkeypatch):
    """`+auto` times the kernels once, as decoding's kernels=auto does, and every forward of that
    setting runs on the winner (make batch's floor: it measured F.linear while decoding ran fused).
    """
    import decode as entry
    from eagle.bench.precision import KernelChoice

    timed, forwards = [], []

    def chooser(model, kernels):
        timed.append(kernels)
        return KernelChoice(kernels="onednn", ms={k: {1: 1.0, 26: 2.0} for k in kernels})

    real = fl.settings_costs

    def costs(target, turns, *args, **kwargs):
        for setting in turns.values():  # which kernels each turn switches the target to
            setting.activate()
            forwards.append(kernels_of(target))
        return real(target, turns, *args, **kwargs)

    monkeypatch.setattr(builder, "faster_kernels", chooser)
    monkeypatch.setattr(fl, "settings_costs", costs)
    out = tmp_path / "floor"
    entry.decode(
        compose_config(
            "decode",
            [
                f"target={target_dir}",
                "mode=floor",
                "floor.tokens=[1,2]",
                "floor.context=8",
                "floor.repeats=1",
                "floor.buffer_mb=8",
                "floor.peak_size=64",
                "floor.product_rows=[]",
                "floor.settings=[dynamic,dynamic+auto]",
                f"floor.out_dir={out}",
            ],
        )
    )
    assert (
        len(timed) == 1 and "default" in timed[0]
    )  # timed once, over every setting that runs here
    assert forwards == ["default", "onednn"]
    report = json.loads((out / "floor.json").read_text())
    assert report["auto_kernels"]["kernels"] == "onednn" and set(report["settings"]) == {
        "dynamic",
        "dynamic+auto",
    }
    assert "`+auto` ran on **onednn**" in (out / "floor.md").read_text()
    # decoding's rules, not only its timing: no packed products in bf16, so nothing is timed
    timed.clear()
    entry.decode(
        compose_config(
            "decode",
            [
                f"target={target_dir}",
                "mode=floor",
                "floor.tokens=[1]",
                "floor.dtype=bfloat16",
                "floor.context=8",
                "floor.repeats=1",
                "floor.buffer_mb=8",
                "floor.peak_size=64",
                "floor.product_rows=[]",
                "floor.settings=[dynamic+auto]",
                f"floor.out_dir={out}",
            ],
        )
    )
    assert (
        not timed
        and json.loads((out / "floor.json").read_text())["auto_kernels"]["kernels"] == "default"
    )
    assert "nothing to time" in (out / "floor.md").read_text()


def test_the_floor_runs_from_the_library_without_the_config(tmp_path):
    """`parse_settings` and `measure_floor` are the floor mode's work on plain arguments: a
    setting of kernels auto needs the kernels chosen for it, and the report holds each setting."""
    target = make_tiny_model("llama")
    settings = fl.parse_settings(["dynamic", "dynamic+auto"])
    assert settings == {
        "dynamic": ("dynamic", False, "default"),
        "dynamic+auto": ("dynamic", False, "auto"),
    }
    with pytest.raises(ValueError, match="no choice of kernels"):
        fl.measure_floor(
            target, settings, tokens=[1], context=4, repeats=1, buffer_mb=8, peak_size=64
        )
    report = fl.measure_floor(
        target,
        {"dynamic": settings["dynamic"]},
        tokens=[1, 2],
        context=4,
        repeats=1,
        buffer_mb=8,
        peak_size=64,
    )
    assert (
        set(report["settings"]) == {"dynamic"}
        and report["floor_ms"] > 0
        and "products" not in report
    )
    assert [r["tokens"] for r in report["settings"]["dynamic"]["forwards"]] == [1, 2]

"""Progress in a log file: whole lines every so often, never tqdm's carriage returns.

Under pytest stderr is not a terminal, as in a log file: `progress` must give lines there."""

from __future__ import annotations

import io

import pytest

from eagle.progress import LineBar, clock, on_terminal, progress
from helpers.configs import compose_config
from helpers.data import conversations


class Timer:
    """A fake clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_bar_prints_a_whole_line_every_so_often_and_at_the_end():
    out, timer = io.StringIO(), Timer()
    with LineBar(total=40, desc="features", unit="sample", every_s=30, file=out,
                 timer=timer) as bar:
        bar.update(5)  # within 30 s of the start: no line yet
        assert out.getvalue() == ""
        timer.now += 31
        bar.set_postfix_str("1,234 tokens/s", refresh=False)
        bar.update(5)
        timer.now += 10
        bar.update(10)  # 10 s after the last line: none
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2
    assert lines[0].startswith("[features] 10/40 sample, ") and "elapsed 0m31s" in lines[0]
    assert "about 1m33s to go" in lines[0] and lines[0].endswith("| 1,234 tokens/s")
    assert lines[1].startswith("[features] (end) 20/40 sample, ") and "elapsed 0m41s" in lines[1]


def test_a_line_bar_iterates_and_a_disabled_one_prints_nothing():
    out, timer = io.StringIO(), Timer()
    seen = []
    for x in LineBar(range(3), desc="probe", unit="prompt", every_s=0, file=out, timer=timer):
        seen.append(x)
        timer.now += 1
    assert seen == [0, 1, 2]
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("[probe] (end) 3/3 prompt")
    assert len(lines) == 4  # one per update (every_s=0), one at the end
    quiet = io.StringIO()
    with LineBar(total=3, every_s=0, disable=True, file=quiet) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""


def test_progress_gives_lines_without_a_terminal_and_tqdm_when_asked(capsys):
    assert not on_terminal() and not on_terminal(io.StringIO())
    bar = progress(total=2, desc="benchmark", unit="prompt")
    assert isinstance(bar, LineBar)
    bar.update(2)
    bar.close()
    err = capsys.readouterr().err
    assert err.startswith("[benchmark] (end) 2/2 prompt") and "\r" not in err
    from tqdm.auto import tqdm

    forced = progress(total=1, kind="tqdm", disable=True)
    assert isinstance(forced, tqdm)
    forced.close()
    with pytest.raises(ValueError, match="unknown progress kind 'bar'"):
        progress(total=1, kind="bar")
    assert clock(65) == "1m05s" and clock(3725) == "1h02m"


def test_the_feature_dump_writes_lines_into_a_log(target_dir, tmp_path, capfd):
    """`python -m data_gen` with its progress on, output to a file: plain lines."""
    from data_gen.__main__ import generate

    generate(compose_config("data_gen", conversations(
        f"target_path={target_dir}", f"out_dir={tmp_path / 'dump'}", "target_dtype=float32",
        "device=cpu", "max_len=32", "shard_size=8", "batch_size=4", "progress=true",
        "source.max_samples=8", "source.max_val_samples=4")))
    err = capfd.readouterr().err  # transformers' own loading bar may be there too: not ours
    (line,) = [ln for ln in err.split("\n") if "features" in ln]
    assert line.startswith("[features] (end) 12/12 sample") and "tokens/s" in line


def test_the_libraries_bars_are_off_in_a_log_file_only():
    """transformers' weight loading and datasets' writes would redraw into a log file."""
    import io

    import datasets
    from transformers.utils import logging as hf_logging

    from eagle.progress import quiet_library_bars

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    try:
        quiet_library_bars(Terminal())
        assert hf_logging.is_progress_bar_enabled() and datasets.is_progress_bar_enabled()
        quiet_library_bars(io.StringIO())
        assert not hf_logging.is_progress_bar_enabled()
        assert not datasets.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
        datasets.enable_progress_bars()

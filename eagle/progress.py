"""Progress that a log file can show: a tqdm bar on a terminal, plain lines elsewhere.

A tqdm bar redraws one line with carriage returns. In a file every redraw stays, so a long
feature dump leaves one line of tens of kilobytes that no reader opens. `progress` keeps the
bar where stderr is a terminal and gives a `LineBar` otherwise: the same calls (`update`,
`set_postfix_str`, `write`, `close`, iteration, `with`), but a whole line every `every_s`
seconds and one at the end. Training's Lightning callback follows the same rule
(`eagle.training.progress`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

EVERY_S = 30.0  # seconds between two lines in a log: often enough to see a run move, few lines
KINDS = ("auto", "tqdm", "lines")


def on_terminal(stream: IO | None = None) -> bool:
    """Whether `stream` (stderr by default, where the bars go) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def quiet_library_bars(stream: IO | None = None) -> None:
    """Off a terminal, switch off the bars of the libraries the entry points call (transformers'
    weight loading, datasets' writes): each would redraw into a log file as one long line."""
    if on_terminal(stream):
        return
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def clock(seconds: float) -> str:
    """A duration as a log line shows it: 4m05s, or 1h02m past an hour."""
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class LineBar:
    """tqdm's calls, printed as whole lines on `file` (stderr by default): one every `every_s`
    seconds while it runs and one when it closes. Each line gives the count, the rate, the
    time spent and the time still needed, and the postfix a caller set."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", disable: bool = False, every_s: float = EVERY_S,
                 file: IO | None = None, timer: Callable[[], float] = time.monotonic):
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.disable, self.every_s, self.file, self._timer = disable, every_s, file, timer
        self.n, self.postfix, self.closed = 0, "", False
        self._start = self._last = timer()

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update()
        self.close()

    def __enter__(self) -> LineBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._timer()
        if now - self._last >= self.every_s:
            self._last = now
            self._line()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s  # shown on the next line, not at once: a line per update would flood

    def write(self, s: str) -> None:
        """A line of the caller's own, as tqdm.write prints it (on stdout)."""
        print(s, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line("end")

    def _line(self, event: str = "") -> None:
        if self.disable:
            return
        elapsed = self._timer() - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        count = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        parts = [f"{count} {self.unit}"]
        if rate > 0:
            parts.append(f"{rate:.3g} {self.unit}/s")
        parts.append(f"elapsed {clock(elapsed)}")
        if rate > 0 and self.total and self.n < self.total:
            parts.append(f"about {clock((self.total - self.n) / rate)} to go")
        tag = f"[{self.desc}]" + (f" ({event})" if event else "")
        postfix = f" | {self.postfix}" if self.postfix else ""
        print(f"{tag} {', '.join(parts)}{postfix}", file=self.file or sys.stderr, flush=True)


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", disable: bool = False, every_s: float = EVERY_S, kind: str = "auto"):
    """A progress bar over `iterable` or up to `total`: tqdm where stderr is a terminal (or with
    kind "tqdm"), else a `LineBar` (kind "lines"), so a log file gets readable lines."""
    if kind not in KINDS:
        raise ValueError(f"unknown progress kind {kind!r}: {', '.join(KINDS)}")
    if kind == "tqdm" or (kind == "auto" and on_terminal()):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable)
    return LineBar(iterable, total=total, desc=desc, unit=unit, disable=disable, every_s=every_s)

"""Progress display: a rich progress bar when the output is a terminal, else one plain line per configuration run
on stderr (what a log file or the GPU machine's captured output wants)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Silent base: the runner calls these hooks."""

    def start(self, total: int) -> None: ...
    def begin(self, index: int, round_: int, rounds: int, name: str) -> None: ...
    def step(self, text: str) -> None: ...
    def end(self, line: str) -> None: ...
    def note(self, text: str) -> None: ...
    def close(self) -> None: ...


class PlainProgress(Progress):
    def __init__(self, file: TextIO | None = None):
        self.file = file or sys.stderr
        self.total = 0
        self.t0 = time.monotonic()
        self._prefix = ""

    def _print(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", file=self.file, flush=True)

    def start(self, total: int) -> None:
        self.total = total

    def begin(self, index: int, round_: int, rounds: int, name: str) -> None:
        self._prefix = f"{index}/{self.total} round {round_}/{rounds} {name}"
        self._print(f"{self._prefix}: starting")

    def end(self, line: str) -> None:
        self._print(f"{self._prefix}: {line}")

    def note(self, text: str) -> None:
        self._print(text)


class RichProgress(Progress):
    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, TextColumn, TimeElapsedColumn

        self._p = RP(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=Console(stderr=True), transient=False)
        self._task = None
        self._name = ""

    def start(self, total: int) -> None:
        self._p.start()
        self._task = self._p.add_task("bench", total=total)

    def begin(self, index: int, round_: int, rounds: int, name: str) -> None:
        self._name = f"round {round_}/{rounds} · {name}"
        self._p.update(self._task, description=f"{self._name} · loading")

    def step(self, text: str) -> None:
        self._p.update(self._task, description=f"{self._name} · {text}")

    def end(self, line: str) -> None:
        self._p.console.print(f"{self._name}: {line}", highlight=False, markup=False)
        self._p.advance(self._task)

    def note(self, text: str) -> None:
        self._p.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        self._p.stop()


def make_progress(kind: str = "auto") -> Progress:
    """``auto``: a progress bar on a terminal, else plain lines; ``rich``; ``plain``; ``none``."""
    if kind == "none":
        return Progress()
    if kind == "rich" or (kind == "auto" and sys.stderr.isatty()):
        return RichProgress()
    return PlainProgress()

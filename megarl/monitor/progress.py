"""Progress on rank 0: the step loop's, and lines for the phases outside it (start-up, evaluation, export).

``StepProgress`` draws a tqdm bar on a terminal and writes one plain line per
step anywhere else (a log file, SLURM's ``.out``, a pipe through ``tee``), where
a bar's carriage returns would pile every step onto one line. ``stage`` writes
``what ...`` when a phase starts and ``done (detail, 1.2 s)`` on the same line
when it ends, for phases that run while no bar is drawn; ``note`` writes a whole
line through tqdm, so it lands above a bar that is.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

from tqdm import tqdm


@dataclass
class Stage:
    """What the body of a ``stage`` may add to its closing line."""

    detail: str = ""


@contextmanager
def stage(what: str, enabled: bool = True, stream=None):
    """``with stage("loading actor from DIR", rank == 0) as s: ...; s.detail = "12 tensors"``."""
    out = stream or sys.stdout
    if enabled:
        print(f"{what} ...", end="", file=out, flush=True)
    start, info = time.perf_counter(), Stage()
    try:
        yield info
    except BaseException:
        if enabled:
            print(" failed", file=out, flush=True)
        raise
    if enabled:
        seconds = f"{time.perf_counter() - start:.1f} s"
        print(f" done ({info.detail + ', ' if info.detail else ''}{seconds})", file=out, flush=True)


def note(line: str, enabled: bool = True, stream=None) -> None:
    """One line that keeps a tqdm bar below it intact."""
    if enabled:
        tqdm.write(line, file=stream or sys.stdout)
        (stream or sys.stdout).flush()


class StepProgress:
    """``update(line)`` once per step: a bar showing ``line`` on a terminal, else ``line`` as its own line."""

    def __init__(self, total: int, initial: int, enabled: bool = True, stream=None, tty: bool | None = None):
        self.out = stream or sys.stdout
        self.enabled = enabled
        self.tty = self.out.isatty() if tty is None else tty
        self.bar = None
        if enabled and self.tty:
            self.bar = tqdm(total=total, initial=initial, file=self.out, dynamic_ncols=True)

    def update(self, line: str) -> None:
        if self.bar is not None:
            self.bar.set_description(line)
            self.bar.update(1)
        elif self.enabled:
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

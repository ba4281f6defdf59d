"""Progress lines for the phases outside the step loop (start-up, evaluation, export), rank 0 only.

``stage`` writes ``what ...`` when the phase starts and ``done (detail, 1.2 s)``
on the same line when it ends, for phases that run while no progress bar is
drawn; ``note`` writes a whole line through tqdm, so it lands above a bar that is.
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

"""Reading a run directory's logs: ``metrics.jsonl`` (by step) and ``events.jsonl`` (milestones).

A run that is still writing may have a torn last line; it is skipped. A bad
line anywhere else is a :class:`RunDirError` naming file and line.
"""
from __future__ import annotations

import json
import os

from megarl.errors import UserInputError


class RunDirError(UserInputError):
    """A run directory that cannot be read as asked; printed as one line, exit 2."""

    kind = "run dir error"


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSONL file; a torn last line (a run still writing) is left out."""
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    rows = []
    for n, (i, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines) - 1 and not line.endswith("\n"):
                break
            raise RunDirError(f"{path}:{i}: not JSON ({e.msg}); the file is damaged") from None
    return rows


def read_metrics(path: str) -> dict[int, dict[str, float]]:
    """metrics.jsonl as {step: merged row}: later rows of a step add to it; null (non-finite) values are dropped."""
    rows: dict[int, dict[str, float]] = {}
    for row in read_jsonl(path):
        step = int(row.pop("step"))
        rows.setdefault(step, {}).update({k: v for k, v in row.items() if v is not None})
    return rows


def read_events(run_dir: str) -> list[dict]:
    """events.jsonl of a run dir (start, export, end, stopped); [] when absent."""
    path = os.path.join(run_dir, "events.jsonl")
    return read_jsonl(path) if os.path.isfile(path) else []


def series(rows: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, in step order."""
    steps = [s for s in sorted(rows) if key in rows[s]]
    return steps, [rows[s][key] for s in steps]

"""Read prompt rows from JSONL / Parquet and validate them one at a time.

A row is a JSON object with either `prompt` (str) or `messages`
(list of {role, content}), an optional `answer` (alias `ground_truth`),
an optional `extra` dict, and any other columns (they go into `extra`).
Every problem is reported as one line naming `file:line` (JSONL, 1-based)
or `file:row N` (Parquet, 0-based row index).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from megarl.errors import DataError

KNOWN_KEYS = ("prompt", "messages", "answer", "ground_truth", "extra")


@dataclass
class RawRow:
    """One validated row before templating and tokenization."""

    where: str  # "path:line" for error messages
    prompt: str | None = None  # plain text prompt, or None when messages is set
    messages: list[dict[str, str]] | None = None  # chat messages, or None
    answer: str | None = None  # ground truth, stringified
    extra: dict[str, Any] = field(default_factory=dict)  # free fields for rewards


def iter_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (where, record); record is the decoded object or a ValueError."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: prompt data file not found; check data.paths")
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        yield from _iter_jsonl(path)
    else:
        raise DataError(f"{path}: unknown data file type {path.suffix!r}; use .jsonl or .parquet")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:  # bytes, so one line that is not UTF-8 is a bad row, not a crash
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                        "re-encode the file as UTF-8")
                continue
            if not line.strip():
                continue  # blank lines are not rows
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, DataError(f"{where}: bad JSON ({e.msg} at column {e.colno}); fix the line")


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())[:160]}); "
                        "rewrite it or use .jsonl") from None
    for i, rec in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", rec


def parse_row(where: str, rec: Any) -> RawRow:
    """Validate one decoded record; raise ValueError naming `where` and the fix."""
    if isinstance(rec, Exception):
        raise rec
    if not isinstance(rec, dict):
        raise DataError(f"{where}: row is a {type(rec).__name__}, not an object; write one JSON object per line")
    prompt, messages = rec.get("prompt"), rec.get("messages")
    if prompt is None and messages is None:
        raise DataError(f"{where}: row has neither 'prompt' nor 'messages' (its columns: "
                        f"{', '.join(map(str, rec))}); name the prompt column with data.prompt_key (e.g. "
                        "data.prompt_key=question data.answer_key=answer) or map rows with data.row_map")
    if prompt is not None and messages is not None:
        raise DataError(f"{where}: row has both 'prompt' and 'messages'; keep one of them")
    if prompt is not None and not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' is a {type(prompt).__name__}; it must be a string")
    return RawRow(where=where, prompt=prompt,
                  messages=None if messages is None else _check_messages(where, messages),
                  answer=_pick_answer(where, rec), extra=_collect_extra(where, rec))


def _check_messages(where: str, messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{j}] must be an object with string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _pick_answer(where: str, rec: dict) -> str | None:
    answer, gt = rec.get("answer"), rec.get("ground_truth")
    if answer is not None and gt is not None:
        raise DataError(f"{where}: row has both 'answer' and 'ground_truth'; keep one of them")
    value = answer if answer is not None else gt
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{where}: 'answer' is a {type(value).__name__}; it must be a string or number")


def _collect_extra(where: str, rec: dict) -> dict[str, Any]:
    extra = rec.get("extra")
    if isinstance(extra, str):  # Parquet writers often store dicts as JSON strings
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError:
            pass
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra' is a {type(extra).__name__}; it must be an object")
    unknown = {k: v for k, v in rec.items() if k not in KNOWN_KEYS}
    return {**unknown, **(extra or {})}  # explicit extra wins over loose columns

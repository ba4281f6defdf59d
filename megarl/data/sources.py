"""Where prompt rows come from: files, `datasets` directories, hub names; and column mapping.

    for where, rec in iter_source("data/gsm8k.parquet"): ...        # .jsonl / .json / .parquet
    for where, rec in iter_source("saved_dir", split="train"): ...  # datasets' save_to_disk
    for where, rec in iter_source("openai/gsm8k", split="test", subset="main"): ...  # the hub

A source is a local file (by its suffix), a local directory written by
``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` read at
``split``), or else a hub dataset name loaded with ``datasets.load_dataset``
(``subset`` is its configuration name). Records are plain dicts.

``map_columns`` turns a record into megarl's row shape (``prompt`` or
``messages``, ``answer``, other columns into ``extra``): ``prompt_key`` and
``answer_key`` rename columns; ``row_map`` (``module:function``, ``fn(row:
dict) -> dict``) rewrites the whole row instead.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from megarl.errors import DataError, ExtensionError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Columns:
    """How a source's columns become megarl's row (data.prompt_key, data.answer_key, data.row_map)."""

    prompt_key: str = "prompt"  # column holding the prompt text (or a list of chat messages)
    answer_key: str = "answer"  # column holding the ground truth
    row_map: str = ""  # module:function(row) -> row; when set the keys above are not used


def is_saved_dataset(path: str | Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk``."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in _SAVED_MARKERS)


def source_kind(path: str) -> str:
    """"file", "saved" or "hub"; raises DataError for a path that is none of them."""
    p = Path(path)
    if p.is_file():
        return "file"
    if is_saved_dataset(p):
        return "saved"
    if p.is_dir():
        raise DataError(f"{path}: a directory but not a saved dataset (no {' / '.join(_SAVED_MARKERS)}); "
                        f"point at a {' / '.join(FILE_SUFFIXES)} file or a datasets.save_to_disk directory")
    if p.suffix in FILE_SUFFIXES or not _HUB_NAME.match(path) or path.startswith((".", "/")):
        raise DataError(f"{path}: prompt data file not found; check the path (relative paths start at the "
                        f"working directory)")
    return "hub"


def iter_source(path: str, split: str | None = None, subset: str | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (where, record) from a file, a saved dataset or a hub dataset (see the module docstring)."""
    from megarl.data.rows import iter_records

    kind = source_kind(path)
    if kind == "file":
        yield from iter_records(path)
        return
    table, used = _load_saved(path, split) if kind == "saved" else (_load_hub(path, split, subset), split or "train")
    for i, rec in enumerate(table):
        yield f"{path}[{used}]:row {i}" if used else f"{path}:row {i}", rec


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading a saved or hub dataset needs the `datasets` package: pip install datasets") from None
    return datasets


def _load_saved(path: str, split: str | None):
    """(rows, the split read or None for a plain Dataset)."""
    datasets = _datasets()
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: the saved dataset has splits {sorted(loaded)}, not {split!r}; "
                            f"set the split (data.train_split / data.eval_split / split: of the entry)")
        return loaded[split], split
    return loaded, None


def _load_hub(name: str, split: str | None, subset: str | None):
    datasets = _datasets()
    try:
        return datasets.load_dataset(name, subset, split=split or "train")
    except Exception as e:  # noqa: BLE001 - offline, unknown name, missing config or split: one line
        text = " ".join(str(e).split())[:200]
        raise DataError(f"{name}: not a local file or directory, and loading it as a hub dataset failed "
                        f"({type(e).__name__}: {text}); check the name, split and subset, or download it "
                        f"and save_to_disk") from None


def load_row_map(path: str) -> Callable[[dict], dict]:
    """The ``data.row_map`` function (``module:function``), imported once."""
    from megarl.algos.registry import load_dotted

    try:
        return load_dotted(path)
    except ValueError as e:
        raise DataError(f"data.row_map={path!r}: {' '.join(str(e).split())}; write module:function with the "
                        "module in the working directory or beside the yaml") from None


def map_columns(where: str, rec: Any, columns: Columns, row_map: Callable[[dict], dict] | None = None) -> Any:
    """The record in megarl's row shape; other values (errors, non-dicts) pass through to parse_row."""
    if not isinstance(rec, dict):
        return rec
    if row_map is not None:
        out = row_map(dict(rec))
        if not isinstance(out, dict):
            raise ExtensionError(f"{where}: data.row_map={columns.row_map} returned a {type(out).__name__}; "
                                 "return a dict with prompt (or messages), answer and any other fields")
        return out
    out = dict(rec)
    if columns.prompt_key != "prompt":
        if columns.prompt_key not in out:
            raise DataError(f"{where}: row has no {columns.prompt_key!r} column (data.prompt_key); "
                            f"its columns: {', '.join(map(str, rec))}")
        value = out.pop(columns.prompt_key)
        out["messages" if isinstance(value, list) else "prompt"] = value
    if columns.answer_key != "answer" and columns.answer_key in out:
        out["answer"] = out.pop(columns.answer_key)
    return out

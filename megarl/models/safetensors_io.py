"""Reading slices of, and writing, Hugging Face safetensors checkpoints.

A checkpoint is either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). The
reader opens each file once and reads row / column ranges through
``safe_open(...).get_slice``, so a rank pulls only the bytes it owns.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.models.hf_config import ModelConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


_REFETCH = "download or export the model again (an interrupted copy?)"


def _read_index(index: str) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``: tensor name -> file."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ModelConfigError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); {_REFETCH}") from None
    if not isinstance(weight_map, dict):
        raise ModelConfigError(f"{index}: weight_map is not a mapping of tensor names to files; {_REFETCH}")
    return dict(weight_map)


class CheckpointReader:
    """Name -> file lookup and sliced reads over a HF safetensors checkpoint.

    Every file's header is read when the reader is made, so a truncated,
    empty or foreign file, or one the index names but the directory lacks,
    is a ModelConfigError naming the file on every rank at once.
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            self.files = _read_index(index)
        elif os.path.isfile(os.path.join(path, SINGLE)):
            self.files = None
        else:
            raise ModelConfigError(f"{path!r} has neither {SINGLE} nor {INDEX} (only safetensors load)")
        files = sorted(set(self.files.values())) if self.files is not None else [SINGLE]
        self._handles = {file: self._open(file) for file in files}
        held = {file: set(handle.keys()) for file, handle in self._handles.items()}
        if self.files is None:
            self.files = {name: SINGLE for name in held[SINGLE]}
        lost = next(((n, f) for n, f in self.files.items() if n not in held[f]), None)
        if lost:
            raise ModelConfigError(f"{os.path.join(path, lost[1])} lacks {lost[0]}, which {INDEX} places there; "
                                   f"{_REFETCH}")

    def _open(self, file: str):
        full = os.path.join(self.path, file)
        if not os.path.isfile(full):
            raise ModelConfigError(f"{full} is missing ({INDEX} names it); {_REFETCH}")
        try:
            return safe_open(full, framework="pt")
        except SafetensorError as e:
            raise ModelConfigError(f"{full} is not a readable safetensors file ({e}): truncated or another format; "
                                   f"{_REFETCH}") from None

    def names(self) -> set[str]:
        return set(self.files)

    def _slice(self, name: str):
        return self._handles[self.files[name]].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name``, optionally only rows ``[r0, r1)`` and / or columns ``[c0, c1)``."""
        sl = self._slice(name)
        r = slice(*rows) if rows else slice(None)
        if cols is None:
            return sl[r]
        return sl[r, slice(*cols)]

    def close(self) -> None:
        self._handles.clear()


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy split of names (in order) into files of at most ``max_bytes`` (a bigger tensor gets its own)."""
    files, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_bytes:
            files.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        files.append(current)
    return files


def shard_file_name(index: int, total: int) -> str:
    """HF's name for file ``index`` (0-based) of ``total``; one file is ``model.safetensors``."""
    return SINGLE if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def default_mode(path: str) -> None:
    """Gives ``path`` the mode ``open`` gives a new file under the umask (0644 under 022).

    safetensors writes its files 0600, and a file rewritten in place keeps its
    old mode (a read-only one copied from an installed package, say).
    """
    umask = os.umask(0)  # the only way to read it; set straight back
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    default_mode(path)


def write_index(out_dir: str, weight_map: dict[str, str], total_bytes: int) -> None:
    path = os.path.join(out_dir, INDEX)
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": total_bytes},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    default_mode(path)

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
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.models.hf_config import ModelConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointReader:
    """Name -> file lookup and sliced reads over a HF safetensors checkpoint."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.files = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(path, SINGLE)):
            with safe_open(os.path.join(path, SINGLE), framework="pt") as f:
                self.files = {name: SINGLE for name in f.keys()}
        else:
            raise ModelConfigError(f"{path!r} has neither {SINGLE} nor {INDEX} (only safetensors load)")
        self._handles = {}

    def names(self) -> set[str]:
        return set(self.files)

    def _slice(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self._handles[file].get_slice(name)

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

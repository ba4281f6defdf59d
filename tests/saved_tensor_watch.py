"""What autograd graphs still hold: every tensor saved for backward, while the watch is on, sits behind a
small holder (the tensor's values, no graph) that lives exactly as long as the graph node keeps it (a node frees what it saved once
backward ran it, or when the graph is dropped). Holders still alive = saved tensors a graph still holds.

    with SavedWatch() as watch:
        loss = model(x).sum(); loss.backward()
        assert watch.alive() == (0, 0)   # (tensors, bytes of their storages)
"""
from __future__ import annotations

import gc
import weakref

import torch


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedWatch:
    """Counts the saved-for-backward tensors still held by graphs made while it is entered."""

    def __init__(self):
        self.holders: weakref.WeakSet = weakref.WeakSet()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Held:
        # detached: a saved *output* held with its grad_fn would form a cycle through the node that gc
        # cannot see (node -> holder -> tensor -> node), keeping a graph that backward never runs alive
        held = _Held(tensor.detach())
        self.holders.add(held)
        return held

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def __enter__(self) -> "SavedWatch":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def alive(self) -> tuple[int, int]:
        """(saved tensors still held, bytes of their distinct storages)."""
        gc.collect()
        held = [h.tensor for h in list(self.holders)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t.device.type != "meta"}
        return len(held), sum(storages.values())

    def describe(self) -> list[tuple]:
        """(shape, dtype) of each saved tensor still held."""
        gc.collect()
        return sorted((tuple(h.tensor.shape), str(h.tensor.dtype)) for h in list(self.holders))

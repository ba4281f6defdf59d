"""The last value made from some tensors, remembered: callers that pass the same tensors once per
layer (every layer of a step or micro-batch reads the same positions, tables, block table) make it once.

    slot, mask = remembered("decode plan", (block_table, seq_lens), (page,), make)

``make()`` runs again when any anchor is another tensor (by identity) or was changed in place (its
``_version``), or when ``key`` differs. Anchors are held until the next value is made, so their
memory cannot be reused by a new tensor that would look the same. One value per ``name``.
Anchors must not be inference tensors (they keep no version counter).
"""
from __future__ import annotations

_LAST: dict = {}  # name -> (anchors, stamp, value)


def remembered(name, anchors: tuple, key: tuple, make):
    stamp = (tuple(a._version for a in anchors), key)
    held = _LAST.get(name)
    if held is None or held[1] != stamp or any(h is not a for h, a in zip(held[0], anchors)):
        held = _LAST[name] = (anchors, stamp, make())
    return held[2]

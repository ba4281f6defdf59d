"""What holds the device memory when a run dies of CUDA out-of-memory: the largest live tensors.

``torch``'s own message gives totals only (allocated, reserved). :func:`oom_report` walks the Python
objects for tensors on the device, groups them by (shape, dtype, parameter or not) and lists the
largest groups, with how much of the allocated memory Python objects account for at all: the rest
is held where no Python object reaches (tensors an autograd graph saved for a backward that never
ran, caches inside extensions). ``megarl.cli.main_guard`` prints it to stderr before the run exits.
"""
from __future__ import annotations

import gc
import warnings
from collections import Counter

import torch

GIB = 2**30


def live_tensors(device_type: str = "cuda") -> Counter:
    """(shape, dtype, is parameter) -> [count, bytes] of the distinct tensors on ``device_type``
    that Python objects hold (each storage counted once)."""
    groups: Counter = Counter()
    counts: Counter = Counter()
    seen: set[tuple[int, int]] = set()
    with warnings.catch_warnings():  # isinstance on deprecated module proxies warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except Exception:  # noqa: BLE001 - objects that break on inspection (lazy modules, proxies) are skipped
            continue
        if key in seen:
            continue
        seen.add(key)
        group = (tuple(obj.shape), str(obj.dtype).removeprefix("torch."), isinstance(obj, torch.nn.Parameter))
        groups[group] += key[1]
        counts[group] += 1
    return Counter({g: (counts[g], groups[g]) for g in groups})


def oom_report(top: int = 12, device_type: str = "cuda") -> str:
    """Lines naming the ``top`` largest groups of live device tensors and the share of the allocated
    memory that Python objects hold."""
    groups = live_tensors(device_type)
    tracked = sum(nbytes for _, nbytes in groups.values())
    allocated = torch.cuda.memory_allocated() if device_type == "cuda" and torch.cuda.is_available() else tracked
    lines = [f"live {device_type} tensors held by Python objects: {tracked / GIB:.2f} GiB of {allocated / GIB:.2f} "
             f"GiB allocated (the rest: saved for a backward, or inside extensions)"]
    largest = sorted(groups.items(), key=lambda item: -item[1][1])[:top]
    for (shape, dtype, param), (count, nbytes) in largest:
        kind = "parameter" if param else "tensor"
        lines.append(f"  {nbytes / GIB:8.2f} GiB  {count:4d} x {kind} {list(shape)} {dtype}")
    return "\n".join(lines)

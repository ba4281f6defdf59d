"""Lets megatron-core run on CPU over gloo (development and CI only).

megatron-core assumes CUDA: it asks for ``torch.cuda.current_device()``, builds
tensors with ``device="cuda"``, calls ``Tensor.cuda()``, checks
``param.type()`` against ``torch.cuda.FloatTensor`` strings and keeps its RNG
in CUDA generators. Without CUDA, :func:`install` maps all of that onto the
CPU: a ``TorchFunctionMode`` rewrites device arguments in one place, a few
``torch.cuda`` functions become CPU equivalents, the "CUDA" RNG state is the
CPU generator's state, and collectives over ranks' splits of unequal sizes go
through equal ones (gloo refuses unequal ones).

The layer is active only when CUDA is absent; with CUDA, :func:`install` does
nothing.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
_installed = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_POSITIONAL_DEVICES = (str, torch.device)  # a positional int is a size, never a device


def _cpu_device_args(args, kwargs):
    """Runs on every torch call of a CPU training step (~30k per tiny PPO step): the common
    case, no device among the arguments, returns them untouched without building new ones."""
    if kwargs:
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs, device="cpu")
    for a in args:
        if isinstance(a, _POSITIONAL_DEVICES):
            return tuple("cpu" if isinstance(x, _POSITIONAL_DEVICES) and _is_cuda_device(x) else x
                         for x in args), kwargs
    return args, kwargs


_NO_KWARGS: dict = {}  # read only
# A mode is off while its handler runs, and torch >= 2.13 sends backward() through the handler:
# the Python autograd Functions it runs (megatron's linears, recompute) would see no mode. These
# calls go on with the mode back on, one dispatch hop skipped (torch.overrides' documented pattern).
_AUTOGRAD_ENTRIES = (torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward)
_redispatch = getattr(torch.overrides, "redispatch_function", None)


class CudaOnCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` to CPU and makes ``.cuda()`` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or _NO_KWARGS
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype) or func(*args)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], int):
            args = (args[0],) + args[2:]  # .to(local_rank) means "to this GPU"
        args, kwargs = _cpu_device_args(args, kwargs)
        if func in _AUTOGRAD_ENTRIES and _redispatch is not None:
            with self:
                return _redispatch(func, types, args, kwargs)
        return func(*args, **kwargs)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_allocated = lambda device=None: 0


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()


class _NullEvent:
    """Stands in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # fork() compares the CPU state before/after; on CPU both RNGs are one.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


def _patch_megatron_uneven_collectives() -> None:
    """megatron-core's sequence-parallel gather / reduce-scatter with per-rank split sizes (the MoE
    alltoall dispatcher's tokens over TP under sequence parallelism: each rank routes its own tokens)
    call list collectives with tensors of unequal sizes, which gloo refuses: the same through even
    ones (pad to the largest split and gather; all-reduce the whole input and keep this rank's split)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))  # (most, ...)
        padded[:input_.size(0)] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])  # (sum(sizes), ...)

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[:group.rank()])
        return total[start:start + sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


@contextlib.contextmanager
def paused():
    """Runs code that never names CUDA without the device-rewriting mode.

    The mode costs microseconds per torch call; the rollout engine's CPU decode loop
    makes tens of thousands of them and builds every tensor on its own device.
    """
    if not _installed:
        yield
        return
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if not isinstance(_get_current_function_mode(), CudaOnCpuMode):
        yield  # another mode sits on top: leave the stack alone
        return
    with _pop_mode_temporarily():
        yield


def install() -> bool:
    """Activates the layer when CUDA is absent; returns whether it is active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        _patch_torch_cuda()
        _patch_megatron_rng()
        _patch_megatron_uneven_collectives()
        CudaOnCpuMode().__enter__()  # stays on for the life of the process
        _installed = True
    return True

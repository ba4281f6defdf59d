"""A CUDA buffer whose memory can be given back and taken again at the same address.

CUDA graphs bake in the addresses they read, but the KV cache should not hold
device memory while the training phases run. CUDA's virtual memory API splits
the two: :class:`PinnedAddressBuffer` reserves an address range once, maps
physical memory onto it for generation (:meth:`map`), and unmaps it before
training (:meth:`unmap`), so the memory returns to the device while the
address — and every graph that reads it — stays valid. The contents do not
survive an unmap (the KV cache does not need them to).

Driver calls go through ``ctypes`` on ``libcuda`` (cuMemAddressReserve,
cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease), the same
mechanism SGLang and vLLM use to sleep their caches; the tensor is a
zero-copy view made through ``__cuda_array_interface__``.
"""
from __future__ import annotations

import ctypes

import torch

_ALLOCATION_PINNED, _LOCATION_DEVICE, _ACCESS_READWRITE = 1, 1, 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                 "cuMemRelease", "cuMemGetAllocationGranularity", "cuMemAddressFree"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


class PinnedAddressBuffer:
    """``nbytes`` (rounded up to the allocation granularity) at an address that never changes."""

    def __init__(self, nbytes: int, device: torch.device):
        torch.cuda.init()
        self.device = device
        self.lib = _driver()
        self.prop = _AllocationProp(type=_ALLOCATION_PINNED,
                                    location=_Location(_LOCATION_DEVICE, device.index or 0))
        granularity = ctypes.c_size_t()
        self._check(self.lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self.prop), 0),
                    "cuMemGetAllocationGranularity")
        g = granularity.value
        self.nbytes = -(-nbytes // g) * g
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes),
                                                 ctypes.c_size_t(g), ctypes.c_uint64(0), ctypes.c_ulonglong(0)),
                    "cuMemAddressReserve")
        self.ptr = ptr.value
        self.handle = None
        self.map()
        self.bytes = torch.as_tensor(_CudaArray(self.ptr, self.nbytes), device=device)  # (nbytes,) uint8

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise RuntimeError(f"{call} failed with CUDA driver error {code}")

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def map(self) -> None:
        """Physical memory onto the reserved range (contents undefined)."""
        if self.mapped:
            return
        handle = ctypes.c_uint64()
        self._check(self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes),
                                         ctypes.byref(self.prop), ctypes.c_ulonglong(0)), "cuMemCreate")
        self._check(self.lib.cuMemMap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                                      handle, ctypes.c_ulonglong(0)), "cuMemMap")
        access = _AccessDesc(_Location(_LOCATION_DEVICE, self.device.index or 0), _ACCESS_READWRITE)
        self._check(self.lib.cuMemSetAccess(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes),
                                            ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        self.handle = handle

    def unmap(self) -> None:
        """Gives the physical memory back; the address stays reserved for :meth:`map`."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)
        self._check(self.lib.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        self._check(self.lib.cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The first bytes as a tensor of ``shape`` and ``dtype`` (zero copy)."""
        count = 1
        for n in shape:
            count *= n
        item = torch.empty((), dtype=dtype).element_size()
        return self.bytes[: count * item].view(dtype).view(shape)

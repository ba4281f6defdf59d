"""Flatten many tensors into one contiguous 1-D bucket and back (weight sync).

Spec (`pack_ref`, `unpack_into_ref`). A `BucketLayout` places tensor i at
element offset offsets[i] of a 1-D bucket of one dtype; every offset is a
multiple of `align_bytes` (default 16 B) and the gap after a tensor up to the
next offset is zero in a packed bucket. `unpack` returns views of the bucket
(no copy); `unpack_into` copies the bucket into existing tensors.

Kernel. One launch moves everything, one pass: each program copies BLOCK
elements of one tensor, found through a per-block table (block -> tensor),
with the tensor's address given as an element offset from the bucket's own
pointer, so no pointer casts are needed. When every address, offset and size
is a multiple of 16 B, `tl.multiple_of` hints let the copy use 16 B accesses.
Tables depend only on the layout (cached on it) and the tensors' addresses
(a small cache keyed by them), so repeated syncs of the same parameters do no
host-to-device work and can be captured in a CUDA graph.
"""
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from megarl_kernels.dispatch import choose, tl, triton

# Elements per program: 8192 bf16 = 16 KiB, 32 per thread at 8 warps (four
# 16 B accesses). Unswept on H200; `benchmarks/bench_kernels.py` sweeps 4096/8192/16384.
BLOCK = 8192
NUM_WARPS = 8
_PTR_CACHE_SIZE = 4  # address tables kept per layout (e.g. pack + unpack_into targets)


@dataclass
class BucketLayout:
    """Placement of tensors in a flat bucket (element units)."""

    shapes: list  # per tensor: torch.Size
    dtype: torch.dtype  # the bucket's (and every tensor's) dtype
    offsets: list  # per tensor: first element in the bucket
    numels: list  # per tensor: elements
    segments: list  # per tensor: elements up to the next offset (numel + zero padding)
    numel: int  # total bucket elements
    _cache: dict = field(default_factory=dict, repr=False)


def bucket_layout(tensors_or_shapes, dtype=None, align_bytes: int = 16) -> BucketLayout:
    """Layout for tensors (or shapes, then pass dtype) packed in order."""
    items = list(tensors_or_shapes)
    if dtype is None:
        dtypes = {t.dtype for t in items}
        if len(dtypes) > 1:
            raise ValueError(f"one bucket holds one dtype, got {sorted(map(str, dtypes))}; group tensors by dtype")
        dtype = dtypes.pop() if dtypes else torch.float32
    shapes = [torch.Size(t.shape if isinstance(t, torch.Tensor) else t) for t in items]
    align = max(1, align_bytes // torch.empty((), dtype=dtype).element_size())
    numels = [s.numel() for s in shapes]
    segments = [-(-n // align) * align for n in numels]
    offsets = [0, *accumulate(segments)][:-1]
    return BucketLayout(shapes, dtype, offsets, numels, segments, sum(segments))


def _layout_for(tensors, layout):
    layout = layout or bucket_layout(tensors)
    if [t.shape for t in tensors] != layout.shapes or any(t.dtype != layout.dtype for t in tensors):
        raise ValueError("tensors do not match the bucket layout (shapes/dtypes differ)")
    return layout


def unpack(bucket, layout: BucketLayout):
    """Views of the bucket, one per tensor, shaped as in the layout (no copy)."""
    return [bucket[o:o + n].view(s) for o, n, s in zip(layout.offsets, layout.numels, layout.shapes)]


def _zero_gaps(bucket, layout: BucketLayout):
    for o, n, seg in zip(layout.offsets, layout.numels, layout.segments):
        if seg > n:
            bucket[o + n:o + seg].zero_()


def _check_bucket(bucket, layout: BucketLayout):
    if bucket.dim() != 1 or bucket.numel() != layout.numel or bucket.dtype != layout.dtype:
        raise ValueError(f"bucket must be 1-D {layout.dtype} of {layout.numel} elements, got "
                         f"{tuple(bucket.shape)} {bucket.dtype}")


def pack_ref(tensors, layout: BucketLayout | None = None, out=None):
    """The spec: one copy per tensor into its view, zeros in the gaps."""
    layout = _layout_for(tensors, layout)
    device = tensors[0].device if tensors else "cpu"
    bucket = out if out is not None else torch.empty(layout.numel, dtype=layout.dtype, device=device)
    _zero_gaps(bucket, layout)
    for view, t in zip(unpack(bucket, layout), tensors):
        view.copy_(t)
    return bucket


def unpack_into_ref(bucket, tensors, layout: BucketLayout | None = None):
    """The spec: tensors[i].copy_(view i of the bucket)."""
    for t, view in zip(tensors, unpack(bucket, _layout_for(tensors, layout))):
        t.copy_(view)
    return tensors


@triton.jit
def _bucket_copy_kernel(bucket_ptr, blk_tensor_ptr, first_blk_ptr, toff_ptr, boff_ptr, numel_ptr, seg_ptr,
                        TO_BUCKET: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    pid = tl.program_id(0)
    k = tl.load(blk_tensor_ptr + pid)  # tensor of this block
    start = (pid - tl.load(first_blk_ptr + k)).to(tl.int64) * BLOCK
    toff = tl.load(toff_ptr + k)  # tensor address - bucket address, elements
    boff = tl.load(boff_ptr + k)
    n = tl.load(numel_ptr + k)
    seg = tl.load(seg_ptr + k)
    if ALIGN > 1:
        toff = tl.multiple_of(toff, ALIGN)
        boff = tl.multiple_of(boff, ALIGN)
        n = tl.multiple_of(n, ALIGN)
        seg = tl.multiple_of(seg, ALIGN)
    i = start + tl.arange(0, BLOCK)
    if TO_BUCKET:  # gaps after a tensor are written as zeros
        x = tl.load(bucket_ptr + toff + i, mask=i < n, other=0)
        tl.store(bucket_ptr + boff + i, x, mask=i < seg)
    else:
        x = tl.load(bucket_ptr + boff + i, mask=i < n)
        tl.store(bucket_ptr + toff + i, x, mask=i < n)


def _block_tables(layout: BucketLayout, device):
    """Layout-only tables: (block -> tensor int32, first block per tensor int32, boff, numel, seg int64)."""
    key = ("blocks", str(device), BLOCK)
    if key not in layout._cache:
        blocks = [-(-s // BLOCK) for s in layout.segments]  # the segment covers numel
        first = [0, *accumulate(blocks)][:-1]
        counts = torch.tensor(blocks, dtype=torch.int64)
        blk_tensor = torch.repeat_interleave(torch.arange(len(blocks), dtype=torch.int32), counts)
        as_dev = lambda xs, dt: torch.tensor(xs, dtype=dt).to(device)  # noqa: E731
        layout._cache[key] = (blk_tensor.to(device), as_dev(first, torch.int32), as_dev(layout.offsets, torch.int64),
                              as_dev(layout.numels, torch.int64), as_dev(layout.segments, torch.int64))
    return layout._cache[key]


def _address_table(layout: BucketLayout, bucket, tensors):
    """((tensor address - bucket address) in elements, int64 on the device; ALIGN hint), or None.

    Cached by the addresses, so repeated syncs of the same tensors reuse it."""
    key = ("addr", bucket.data_ptr(), tuple(t.data_ptr() for t in tensors))
    if key not in layout._cache:
        esize = bucket.element_size()
        diffs = [t.data_ptr() - bucket.data_ptr() if t.numel() else 0 for t in tensors]
        if any(d % esize for d in diffs):
            return None
        toff = [d // esize for d in diffs]
        a = max(1, 16 // esize)
        vals = layout.offsets + layout.numels + layout.segments + toff
        align = a if bucket.data_ptr() % 16 == 0 and all(v % a == 0 for v in vals) else 1
        addr = [k for k in layout._cache if k[0] == "addr"]
        for old in addr[: max(0, len(addr) - _PTR_CACHE_SIZE + 1)]:
            del layout._cache[old]
        layout._cache[key] = (torch.tensor(toff, dtype=torch.int64).to(bucket.device), align)
    return layout._cache[key]


def _copy_triton(bucket, tensors, layout: BucketLayout, to_bucket: bool) -> bool:
    """Launch the copy; False if some tensor cannot be addressed (caller falls back)."""
    if any(not t.is_contiguous() or t.device != bucket.device for t in tensors):
        return False
    addr = _address_table(layout, bucket, tensors)
    if addr is None:
        return False
    (toff, align), (blk_tensor, first, boff, numel, seg) = addr, _block_tables(layout, bucket.device)
    if blk_tensor.numel():
        _bucket_copy_kernel[(blk_tensor.numel(),)](bucket, blk_tensor, first, toff, boff, numel, seg,
                                                   TO_BUCKET=to_bucket, BLOCK=BLOCK, ALIGN=align,
                                                   num_warps=NUM_WARPS)
    return True


def pack(tensors, layout: BucketLayout | None = None, out=None, backend: str = "auto"):
    """Copy tensors into one 1-D bucket (new, or `out` of layout.numel elements)."""
    tensors = list(tensors)
    layout = _layout_for(tensors, layout)
    if out is not None:
        _check_bucket(out, layout)
    impl = choose(backend, *tensors)
    if impl == "ref":
        return pack_ref(tensors, layout, out)
    device = tensors[0].device if tensors else "cpu"
    bucket = out if out is not None else torch.empty(layout.numel, dtype=layout.dtype, device=device)
    if impl == "triton" and _copy_triton(bucket, tensors, layout, to_bucket=True):
        return bucket
    _zero_gaps(bucket, layout)  # rare: only after tensors whose size is not a multiple of 16 B
    if tensors:
        torch._foreach_copy_(unpack(bucket, layout), tensors)
    return bucket


def unpack_into(bucket, tensors, layout: BucketLayout | None = None, backend: str = "auto"):
    """Copy the bucket into existing tensors (in place); returns them."""
    tensors = list(tensors)
    layout = _layout_for(tensors, layout)
    _check_bucket(bucket, layout)
    impl = choose(backend, bucket, *tensors)
    if impl == "ref":
        return unpack_into_ref(bucket, tensors, layout)
    if impl == "triton" and _copy_triton(bucket, tensors, layout, to_bucket=False):
        return tensors
    if tensors:
        torch._foreach_copy_(tensors, unpack(bucket, layout))
    return tensors

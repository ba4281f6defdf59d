"""megarl_kernels.bucket: flat weight buckets (the async pipeline's weight push) are bitwise exact.

pack == pack_ref bitwise (zeroed gaps included), unpack / unpack_into round-trip bitwise, on odd
shapes (sizes not a multiple of 16 B, an empty tensor, a misaligned view). On CPU the Triton path
runs in the interpreter.
"""
import torch

from kernel_backends import BACKENDS, DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import importlib  # noqa: E402

import pytest  # noqa: E402

from megarl_kernels.bucket import bucket_layout, pack, pack_ref, unpack, unpack_into  # noqa: E402

bucket_mod = importlib.import_module("megarl_kernels.bucket")
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).to(DEVICE)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _tensor_set(dtype):
    """Odd shapes: 16 B multiples and not, an empty tensor, a misaligned 1-D view, a transposed copy."""
    base = _rand(100, dtype=dtype)
    return [_rand(5, 7, dtype=dtype), _rand(3, dtype=dtype), _rand(0, 4, dtype=dtype), _rand(64, 33, dtype=dtype),
            base[3:50], _rand(9, 4, dtype=dtype).t().contiguous(), _rand(2, 3, 4, dtype=dtype)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bucket_round_trip(backend, dtype):
    ts = _tensor_set(dtype)
    layout = bucket_layout(ts)
    ref = pack_ref(ts, layout)
    assert ref.numel() == layout.numel and all(o % (16 // ref.element_size()) == 0 for o in layout.offsets)
    bucket = pack(ts, layout, backend=backend)
    assert _same(bucket, ref)  # includes the zeroed gaps
    assert all(_same(v, t) for v, t in zip(unpack(bucket, layout), ts))
    outs = [torch.full_like(t, 7) for t in ts]
    unpack_into(bucket, outs, layout, backend=backend)
    assert all(_same(o, t) for o, t in zip(outs, ts))
    again = pack(ts, layout, out=torch.full_like(bucket, 3), backend=backend)  # cached tables, given `out`
    assert _same(again, ref)


@needs_triton
def test_bucket_triton_many_blocks(monkeypatch):
    """BLOCK=64: tensors span several blocks with a ragged last one; 16 B-aligned set (ALIGN hint on)."""
    monkeypatch.setattr(bucket_mod, "BLOCK", 64)
    ts = [_rand(136, dtype=torch.bfloat16), _rand(16, 8, dtype=torch.bfloat16), _rand(200, dtype=torch.bfloat16)]
    layout = bucket_layout(ts)
    bucket = pack(ts, layout, backend="triton")
    assert [v[1] for k, v in layout._cache.items() if k[0] == "addr"] == [8]  # 16 B / bf16
    assert _same(bucket, pack_ref(ts, layout))
    outs = [torch.empty_like(t) for t in ts]
    unpack_into(bucket, outs, layout, backend="triton")
    assert all(_same(o, t) for o, t in zip(outs, ts))


def test_bucket_errors():
    with pytest.raises(ValueError, match="dtype"):
        bucket_layout([_rand(3), _rand(3, dtype=torch.bfloat16)])
    layout = bucket_layout([_rand(3)])
    with pytest.raises(ValueError, match="layout"):
        pack([_rand(4)], layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bucket_large():
    ts = [_rand(4096, 4096, dtype=torch.bfloat16), _rand(4096, dtype=torch.bfloat16),
          _rand(11008, 4096, dtype=torch.bfloat16)]
    layout = bucket_layout(ts)
    assert _same(pack(ts, layout, backend="triton"), pack_ref(ts, layout))

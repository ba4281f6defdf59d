"""A graph step's input ids, some still on the device: gather-or-keep in one launch.

Spec (`feed_tokens_ref`). outputs (n,) fp32 holds the last replays' [tokens; log-probs] (token
ids are exact in fp32 below 2^24); src (B,) int64 names the row of outputs holding row i's token,
or is < 0 where the host wrote it into input_ids (B,) int64:
    ids[i] = int(outputs[src[i]])   if src[i] >= 0
             input_ids[i]            otherwise
Returns (B,) int64. The decode and prefill graphs open with it (`megarl/rollout/graphs.py`):
torch's compare, clamp, index_select, cast and where were five launches, each a fixed cost
in every step, plus the gaps between them.
"""
import torch

from megarl_kernels.dispatch import choose, tl, triton

BLOCK = 1024  # rows per program: a decode graph's batch (<= 1024) in one program; not tuned


def feed_tokens_ref(src, outputs, input_ids):
    """The spec, as torch ops (also the CPU path)."""
    return torch.where(src >= 0, outputs.index_select(0, src.clamp(min=0)).long(), input_ids)


@triton.jit
def _feed_kernel(src_ptr, outputs_ptr, ids_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    src = tl.load(src_ptr + i, mask=ok, other=-1)
    fed = src >= 0
    token = tl.load(outputs_ptr + tl.maximum(src, 0), mask=ok & fed, other=0.0).to(tl.int64)
    own = tl.load(ids_ptr + i, mask=ok & ~fed, other=0)
    tl.store(out_ptr + i, tl.where(fed, token, own), mask=ok)


def feed_tokens(src, outputs, input_ids, backend: str = "auto"):
    """ids (B,) int64 of the spec in the module docstring; "triton" is CUDA-graph capturable."""
    if not (src.shape == input_ids.shape and src.dim() == 1 and outputs.dim() == 1):
        raise ValueError(f"feed_tokens wants src (B,), outputs (n,), input_ids (B,); got {tuple(src.shape)}, "
                         f"{tuple(outputs.shape)}, {tuple(input_ids.shape)}")
    if choose(backend, src, outputs, input_ids) != "triton":
        return feed_tokens_ref(src, outputs, input_ids)
    out = torch.empty_like(input_ids, dtype=torch.int64)
    n = src.shape[0]
    if n:
        _feed_kernel[(triton.cdiv(n, BLOCK),)](src.contiguous(), outputs.contiguous(), input_ids.contiguous(),
                                               out, n, BLOCK=BLOCK)  # unit strides (no copy for the graphs' rows)
    return out

"""Compile the MoE Triton kernels for Hopper (sm_90) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts programs the GPU compiler
rejects (and never allocates shared memory). Triton's ahead-of-time path (``triton.compile`` on an
``ASTSource`` for a ``GPUTarget``) lowers a kernel through TTGIR and PTX to a cubin with the ptxas
that ships in the triton wheel, no driver needed. Integer arguments marked divisible by 16 mimic
the JIT's specialization of the model's sizes and strides (which is what lets the loads pipeline).

    python tests/kernel_aot.py    # prints one JSON line per kernel: name, shared bytes, MMA kind

Run it without TRITON_INTERPRET in the environment: kernels built for the interpreter cannot be
compiled (tests/test_kernel_fused_moe.py starts it as a subprocess).
"""
import importlib
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory a program may use on sm_90


def compile_for_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3):
    """signature: argument -> Triton type ("*bf16", "i32", ...); constexprs: argument -> value. Pointers,
    strides and the sizes F / K / N / H are marked divisible by 16."""
    sig = {a: signature.get(a, "constexpr") for a in fn.arg_names}
    hinted = [a for a, t in sig.items() if t != "constexpr" and (t.startswith("*") or a.startswith("stride")
                                                                  or a in ("F", "K", "N", "H"))]
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in constexprs.items()},
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hinted})
    return triton.compile(src, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})


def moe_kernels():
    """(name, fn, signature, constexprs, warps, stages) of the fused MoE's launches at the Qwen3-30B-A3B
    decode (BLOCK_M 16) and prefill (BLOCK_M 64) tiles, bf16."""
    fm = importlib.import_module("megarl_kernels.fused_moe")
    ma = importlib.import_module("megarl_kernels.moe_align")
    layout = {"sorted_slots_ptr": "*i32", "block_experts_ptr": "*i32", "num_padded_ptr": "*i32", "num_slots": "i32"}
    gate_up = dict(layout, x_ptr="*bf16", w_ptr="*bf16", act_ptr="*bf16", F="i32", K="i32", stride_xt="i32",
                   stride_we="i32", stride_wn="i32", stride_at="i32")
    down = dict(layout, act_ptr="*bf16", w_ptr="*bf16", weights_ptr="*fp32", out_ptr="*fp32", N="i32", K="i32",
                stride_at="i32", stride_we="i32", stride_wn="i32", stride_ot="i32")
    unit = {"stride_xk": 1, "stride_wk": 1}  # the JIT specializes strides of 1 as constants
    kernels = []
    for block_m in (16, 64):
        bn, bk, warps, stages = fm.launch_tiles(block_m)
        kernels.append((f"gate_up BLOCK_M={block_m}", fm._moe_gate_up_kernel, gate_up,
                        dict(unit, TOP_K=8, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=False), warps, stages))
        bn, bk, warps, stages = fm.launch_tiles(block_m)
        kernels.append((f"down BLOCK_M={block_m}", fm._moe_down_kernel, down,
                        dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=False, stride_wk=1), warps, stages))
    align = {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_experts_ptr": "*i32", "num_padded_ptr": "*i32",
             "num_slots": "i32", "num_experts": "i32", "first_expert": "i32", "rows": "i32"}
    kernels.append(("align E=128", ma._moe_align_kernel, align,
                    dict(BLOCK_M=16, E_PAD=128, CHUNK=64, FILL=ma.FILL), 8, 1))
    total = {"contrib_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16", "H": "i32", "num_experts": "i32",
             "first_expert": "i32", "stride_ct": "i32", "stride_ot": "i32"}
    kernels.append(("sum over k", fm._moe_sum_kernel, total, dict(TOP_K=8, BLOCK_H=fm.SUM_BLOCK), 4, 1))
    return kernels


def main():
    for name, fn, signature, constexprs, warps, stages in moe_kernels():
        kernel = compile_for_sm90(fn, signature, constexprs, warps, stages)
        ptx = kernel.asm["ptx"]
        mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
        print(json.dumps(dict(name=name, shared=kernel.metadata.shared, mma=mma, cp_async="cp.async" in ptx)))


if __name__ == "__main__":
    main()

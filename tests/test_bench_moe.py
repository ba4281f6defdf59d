"""The MoE benchmarks' CPU smoke runs write the JSON their GPU runs write, with numbers that add up.

benchmarks/bench_moe_decode.py --tiny (qwen3-moe-tiny: 2 layers, hidden 64, 8 experts of FFN 32,
top-2, 4 query / 2 KV heads of 16, vocab 300 padded to 384) in fp32 and in bf16 with megatron's
GroupedMLP. Derived here from the shape:
- the floor's bytes: dense = 2 layers x (qkv 128x64 + o 64x64 + norms 64+64+16+16 + router 8x64)
  + final norm 64 + head 384x64 = 50,560 elements; an expert 2x32x64 + 64x32 = 6,144 elements; K/V
  B x (12 prompt + 6/2) tokens x 2 (K, V) x 2 layers x 2 groups x 16;
- the HF twin built from GroupedMLP copies q/k/v only: 2 layers x (64 + 32 + 32) rows x 64 x 2 bytes.
Not covered: CUDA graphs, the GPU's timings.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ITEM = {"float32": 4, "bfloat16": 2}


def _run(script: str, out: str, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT}/kernels")
    subprocess.run([sys.executable, f"benchmarks/{script}", "--tiny", "--out", out, *extra], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=300)
    with open(out) as f:
        return json.load(f)


def _floor_ms(dtype: str, b: int, experts: float, hbm: float) -> float:
    item = ITEM[dtype]
    dense, expert, kv = 50_560 * item, 6_144 * item, b * (12 + 3) * 2 * 2 * 2 * 16 * item
    return (dense + experts * expert * 2 + kv) / hbm * 1e3


@pytest.mark.parametrize("dtype,experts", [("float32", "auto"), ("bfloat16", "grouped")])
def test_moe_decode_json(tmp_path, dtype, experts):
    out = _run("bench_moe_decode.py", str(tmp_path / "d.json"), "--dtype", dtype, "--moe-experts", experts,
               "--hf-experts", "grouped_mm,eager")
    assert out["shape"]["num_hidden_layers"] == 2 and out["shape"]["num_experts_per_tok"] == 2
    assert [r["B"] for r in out["rows"]] == [2, 5]
    assert set(out["peak_memory"]) == {"weights", "engine_decode", "expert_count", "generate"}
    twin = out["hf_twin"]
    if dtype == "float32":  # the same model: logits equal up to fp32 rounding
        assert twin["logits_max_diff"] < 1e-4
    else:  # GroupedMLP: the experts are views of megarl's storage, only q/k/v are copies
        assert twin["copied_kinds"] == ["k_proj", "q_proj", "v_proj"]
        assert twin["copied_bytes"] == 2 * 128 * 64 * 2
        assert twin["logits_max_diff"] < 0.25  # bf16 rounding of logits of size ~10
    for r in out["rows"]:
        b = r["B"]
        assert 2 <= r["distinct_experts"] <= min(8, 2 * b)
        assert r["uniform_experts"] == pytest.approx(8 * (1 - (1 - 2 / 8) ** b))
        assert r["floor_ms"] == pytest.approx(_floor_ms(dtype, b, r["distinct_experts"], out["hbm_bytes_per_s"]))
        assert r["pct_of_floor"] == pytest.approx(r["floor_ms"] / r["ms_per_step"])
        assert r["generate_ms_per_step"] == r["generate_by_experts"]["grouped_mm"] > 0
        assert r["speedup_vs_generate"] == pytest.approx(r["generate_ms_per_step"] / r["decode_ms_per_step"])
        assert r["ms_per_step"] == pytest.approx(r["seconds"] / 6 * 1e3)
        assert r["engine_stats"]["rollout/decode_steps"] == 5  # 6 new tokens: 1 from the prefill

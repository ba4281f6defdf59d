"""The MoE benchmarks' CPU smoke runs write the JSON their GPU runs write, with numbers that add up.

benchmarks/bench_moe_decode.py --tiny (qwen3-moe-tiny: 2 layers, hidden 64, 8 experts of FFN 32,
top-2, 4 query / 2 KV heads of 16, vocab 300 padded to 384) in fp32 and in bf16 with megatron's
GroupedMLP. Derived here from the shape:
- the floor's bytes: dense = 2 layers x (qkv 128x64 + o 64x64 + norms 64+64+16+16 + router 8x64)
  + final norm 64 + head 384x64 = 50,560 elements; an expert 2x32x64 + 64x32 = 6,144 elements; K/V
  B x (12 prompt + 6/2) tokens x 2 (K, V) x 2 layers x 2 groups x 16;
- the HF twin built from GroupedMLP copies q/k/v only: 2 layers x (64 + 32 + 32) rows x 64 x 2 bytes.
benchmarks/bench_moe_e2e.py --tiny: GRPO on a qwen3-moe-tiny checkpoint, 2 prompts x 4 samples of 8
tokens, 2 steps; both sides must count the same tokens per step (8 x (13-token templated prompt + 8)),
TRL's side when ``trl`` imports, and the R3 run (fp32: replay or not, the training router picks the
rollout's experts, agreement 1.0) when megarl has ``actor.router_replay``.
Not covered: CUDA graphs, the GPU's timings and memory.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ITEM = {"float32": 4, "bfloat16": 2}


def _run(script: str, out: str, *extra: str, timeout: float = 300) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, f"{ROOT}/kernels", os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, f"benchmarks/{script}", "--tiny", "--out", out, *extra], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=timeout)
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


def _has_router_replay() -> bool:
    from megarl.config import ActorConfig

    return "router_replay" in ActorConfig.__dataclass_fields__


@pytest.mark.slow
def test_moe_e2e_json(tmp_path):
    trl = importlib.util.find_spec("trl") is not None
    r3 = _has_router_replay()
    extra = ["--sides", "megarl,trl" if trl else "megarl", "--work", str(tmp_path / "work")]
    extra += ["--router-replay", "--r3-out", str(tmp_path / "r3.json")] if r3 else []
    out = _run("bench_moe_e2e.py", str(tmp_path / "e.json"), *extra, timeout=900)  # three runs on a shared CPU
    w = out["workload"]
    assert (w["sequences_per_step"], w["response_tokens"], w["router_aux_loss_coef"]) == (8, 8, 0.0)
    assert "rollout.kv_cache_gb=4" in w["megarl_overrides"]
    m = out["megarl"]
    assert m["returncode"] == 0 and m["steps_measured"] == 1
    assert m["tokens_per_step"] == 8 * (13 + 8) and m["response_len_mean"] == 8
    assert 0 < m["rollout_s"] < m["step_s"]
    assert m["tokens_per_s"] == pytest.approx(m["tokens_per_step"] / m["step_s"])
    assert m["mismatch"]["mismatch/abs_mean"] < 1e-4  # fp32: rollout and training log-probs agree
    assert m["kv_released_before_training"] is True
    if trl:
        t = out["trl"]
        assert t["returncode"] == 0 and t["tokens_per_step"] == m["tokens_per_step"]
        assert m["speedup_vs_trl"] == pytest.approx(m["tokens_per_s"] / t["tokens_per_s"])
    if r3:
        with open(tmp_path / "r3.json") as f:
            res = json.load(f)
        assert res["steps"] == 2 and res["run"]["returncode"] == 0
        assert isinstance(res["run"]["peak_memory_by_phase"], dict)  # GiB per phase on CUDA (none on CPU)
        assert res["workload"]["shape"] == "qwen3-moe-tiny" and res["workload"]["response_tokens"] == 8
        assert "actor.router_replay=r3" in res["workload"]["overrides"] and "--router-replay" in res["workload"]["command"]
        for setting in ("none", "r3"):
            assert res[setting]["routing_agreement"] == 1.0
            assert res[setting]["mismatch_mean"] < 1e-4 and res[setting]["mismatch_max"] < 1e-4
        assert res["none_run"]["mismatch_mean"] == m["mismatch"]["mismatch/abs_mean"]

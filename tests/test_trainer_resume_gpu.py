"""On CUDA: a PPO run stopped at a checkpoint and started again equals the run never stopped.

The CPU suite shows this bitwise in fp32 (test_trainer_killresume); on a GPU the run takes
other paths: bf16 weights with fp32 masters, torch's fused AdamW (its step counters on the
device), the rollout's CUDA graphs and Triton kernels, the fused training kernels. The tiny
PPO task with a critic, one process, 4 steps: straight, and 2 steps + a restart to 4 from the
step-2 checkpoint. Every metric but wall-clock and memory readings must be equal (they were
bitwise on an H200, 2026-12-01), except the held-out evaluation the first leg runs as it
ends at step 2.
"""
import pytest
import torch

from test_trainer_killresume import VOLATILE as MACHINE_READINGS
from test_trainer_runs import SMALL, metrics, ppo

VOLATILE = (*MACHINE_READINGS, "rollout/peak_memory_gb")


def _stable(rows: dict, ended_at: int | None = None) -> dict:
    """Metrics without machine readings; without the evaluation of a leg that ended at ``ended_at``."""
    return {step: {k: v for k, v in row.items()
                   if not k.startswith(VOLATILE) and not (step == ended_at and k.startswith("eval/"))}
            for step, row in rows.items()}


def _differences(a: dict, b: dict) -> list[str]:
    out = []
    for step in sorted(a):
        for key in sorted(set(a[step]) | set(b.get(step, {}))):
            x, y = a[step].get(key), b.get(step, {}).get(key)
            if x != y:
                out.append(f"step {step} {key}: {x} != {y}")
    return out


@pytest.mark.gpu
def test_resumed_run_equals_straight_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    common = [*SMALL, "model.dtype=bfloat16", "trainer.save_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ppo("yaml/tiny.yaml", straight, *common, steps=4, nproc=1)
    ppo("yaml/tiny.yaml", resumed, *common, steps=2, nproc=1)
    out = ppo("yaml/tiny.yaml", resumed, *common, steps=4, nproc=1)
    assert "resumed from step 2" in out, out[-2000:]
    a, b = _stable(metrics(straight)), _stable(metrics(resumed), ended_at=2)
    assert sorted(a) == sorted(b) and len(a) >= 4
    diffs = _differences(a, b)
    assert not diffs, f"{len(diffs)} differences, first: " + "; ".join(diffs[:12])

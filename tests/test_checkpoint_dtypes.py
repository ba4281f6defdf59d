"""A bf16 actor (bf16 norms, fp32 masters) saves and resumes exactly.

Saved, loaded, stepped once more: the fp32 masters and the bf16 weights equal the
uninterrupted run's bitwise. Gradients are drawn from the parameter names
(``_adam_step``), so the two runs see the same ones. On CUDA the masters take
torch's fused AdamW, whose step counters must stay on the device after a load
(``set_adam_step``).

Before the norms were built in the params dtype (session 5) a bf16 model held fp32
norm weights beside bf16 ones, and megatron-core 0.16.1 could not save it:
``sharded_param_state_dp_reshardable`` asserts on the grad bucket that mixes them
(tried on this CPU machine with that build). No such checkpoint can exist, so
there is nothing to migrate.
"""
import numpy as np
import pytest
import torch

from dist_helpers import spawn
from test_broken_inputs_checkpoint import _actor, _adam_step, _checkpointer


def _bf16_actor():
    return _actor(1, None, "model.dtype=bfloat16")


def _masters(actor) -> dict:
    """Parameter name -> this rank's fp32 master (the whole parameter: one DP rank)."""
    names = {id(p): n for n, p in actor.module.named_parameters()}
    out = {}
    for opt in actor.trainable.optimizer.chained_optimizers:
        pairs = [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                 *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
        for model_group, shard_group in pairs:
            for p, m in zip(model_group, shard_group):
                out[names[id(p)]] = m.detach().float().cpu().numpy().copy()
    return out


def _weights(actor) -> dict:
    return {n: p.detach().float().cpu().numpy().copy() for n, p in actor.module.named_parameters()}


def _norm_dtypes(actor) -> set:
    return {str(p.dtype) for n, p in actor.module.named_parameters() if "layernorm" in n}


def _fused_flags(actor) -> list:
    return [g.get("fused") for opt in actor.trainable.optimizer.chained_optimizers
            for g in opt.optimizer.param_groups]


def _step_devices(actor) -> set:
    return {st["step"].device.type for opt in actor.trainable.optimizer.chained_optimizers
            for st in opt.optimizer.state.values()}


def _straight_and_resumed(rank, root):
    straight, groups = _bf16_actor()
    ck = _checkpointer(root, groups)
    _adam_step(straight, 1)
    ck.save(1, {"actor": straight}, {"step": 1})
    saved = {"masters": _masters(straight), "weights": _weights(straight)}
    _adam_step(straight, 2)

    resumed, groups = _bf16_actor()
    ck.load(1, {"actor": resumed})
    loaded = {"masters": _masters(resumed), "weights": _weights(resumed), "fused": _fused_flags(resumed),
              "step_devices": _step_devices(resumed)}
    _adam_step(resumed, 2)
    return {"saved": saved, "loaded": loaded, "norm_dtypes": _norm_dtypes(resumed),
            "straight": {"masters": _masters(straight), "weights": _weights(straight)},
            "resumed": {"masters": _masters(resumed), "weights": _weights(resumed)}}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_bf16_actor_resumes_exactly(tmp_path):
    out = spawn(_straight_and_resumed, 1, str(tmp_path))[0]
    assert out["norm_dtypes"] == {"torch.bfloat16"}
    assert any("layernorm" in k for k in out["saved"]["masters"])
    for what in ("masters", "weights"):
        _assert_equal(out["loaded"][what], out["saved"][what])  # back exactly
        _assert_equal(out["resumed"][what], out["straight"][what])  # and the next step is the same
    assert max(abs(out["straight"]["masters"][k] - out["saved"]["masters"][k]).max()
               for k in out["saved"]["masters"]) > 0  # the second step did move the masters
    if torch.cuda.is_available():  # the fused AdamW, its counters still on the device
        assert all(out["loaded"]["fused"]) and out["loaded"]["step_devices"] == {"cuda"}


@pytest.mark.gpu
def test_fused_adam_resumes_on_cuda(tmp_path):
    """The same on CUDA, where the masters take the fused AdamW (skipped elsewhere)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    test_a_bf16_actor_resumes_exactly(tmp_path)

"""Rollout correction inside a real update (2 ranks, CPU): a replayed rollout whose rollout
log-probs were shifted.

One step of yaml/tiny_grpo.yaml is dumped (rollout only); its rollout log-probs are
shifted by +5 on every response token, so every token ratio is rho = pi_old / pi_roll
= exp(-5) up to the fp32 rounding of the shift (old and roll agree exactly on this engine).
Replaying it:
- mode=mis with the default band [0.5, 2]: every token is dropped, so the policy-gradient
  term is 0 on every rank (pg_loss 0) and, with the KL loss off, the actor's gradient is 0
  (grad norm 0); masked_frac = 1, ratio_mean = exp(-5).
- mode=none on the same replay: a non-zero gradient (so the first case can fail).
- mode=tis: weights min(rho, 2) = exp(-5) on every token, so the pg loss and its gradient
  are exp(-5) times the uncorrected ones (the surrogate is linear in the weight; one
  mini-batch, so one optimizer step measured on the same weights), to the rounding of the
  shift (|delta log rho| ~ 5e-7).
Not covered: TP/PP layouts (the correction runs in the head that the layout tests cover).
"""
import glob
import math

import torch

from test_trainer_runs import SMALL, metrics, ppo

# 8 prompts x 4 samples: enough groups with mixed rewards that the uncorrected gradient is not 0
BASE = [*SMALL, "rollout.n=4", "actor.mini_batch_size=32", "actor.kl_loss_coef=0", "trainer.export_hf=false", "trainer.save_last=false"]


def test_shifted_rollout_logprobs_in_a_replayed_update(tmp_path):
    dump = tmp_path / "dump"
    ppo("yaml/tiny_grpo.yaml", tmp_path / "gen", *BASE, "trainer.rollout_only=true", f"trainer.dump_rollouts={dump}",
        steps=1)
    for path in glob.glob(str(dump / "step_*_dp*.pt")):
        d = torch.load(path, weights_only=False)
        d["rollout_logprobs"] = d["rollout_logprobs"] + 5.0 * d["response_mask"]
        torch.save(d, path)
    runs = {}
    for mode in ("mis", "none", "tis"):
        ppo("yaml/tiny_grpo.yaml", tmp_path / mode, *BASE, f"trainer.replay_rollouts={dump}",
            f"algorithm.rollout_correction.mode={mode}", steps=1)
        runs[mode] = metrics(tmp_path / mode)[1]
    mis, off, tis = runs["mis"], runs["none"], runs["tis"]
    assert mis["rollout_correction/masked_frac"] == 1.0 and mis["rollout_correction/truncated_frac"] == 0.0
    assert math.isclose(mis["rollout_correction/ratio_mean"], math.exp(-5), rel_tol=1e-5)
    assert mis["actor/pg_loss"] == 0.0 and mis["actor/grad_norm"] == 0.0
    assert off["actor/grad_norm"] > 0 and off["rollout_correction/masked_frac"] == 0.0
    assert tis["rollout_correction/truncated_frac"] == 0.0  # exp(-5) < cap 2
    # group advantages sum to ~0 over a group's tokens, so the pg loss itself is a small difference:
    # compared absolutely (its scale is |A| ~ 1); the gradient norm has no such cancellation
    assert math.isclose(tis["actor/pg_loss"], math.exp(-5) * off["actor/pg_loss"], abs_tol=1e-7), (tis, off)
    assert math.isclose(tis["actor/grad_norm"], math.exp(-5) * off["actor/grad_norm"], rel_tol=1e-4)

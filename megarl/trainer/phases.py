"""The heavier phases of a PPO step, as functions of the trainer.

Metrics collected here are local sums (``rollout.metrics``), reduced over DP
in :func:`step_metrics`; values already identical on every rank (grad norms,
learning rates, timings) go to ``trainer.metrics``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl.config_checks import uses_critic
from megarl.errors import NonFiniteError
from megarl.rollout.engine import SamplingParams
from megarl.trainer.advantage import compute_rollout_advantages, kl_sum, logprob_mismatch
from megarl.trainer.rollout import generate_rollout
from megarl.trainer.scoring import finish_score_metrics, score_rollout


def _add(metrics: dict, values: dict) -> None:
    for k, v in values.items():
        metrics[k] = metrics.get(k, 0.0) + float(v)


def train_temperature(cfg) -> float:
    """Log-probs are taken under the sampling temperature (1 for greedy)."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def greedy_baseline(tr, prompts, rollout) -> None:
    """ReMax: the score of each prompt's greedy response, per sample."""
    params = SamplingParams(temperature=0.0, stop_token_ids=tuple(tr.cfg.rollout.stop_token_ids))
    greedy = generate_rollout(tr.engine, prompts, params, tr.tokenizer, tr.pad_id, tr.device,
                              n=1, seed=0, max_new_tokens=tr.cfg.rollout.max_new_tokens)  # greedy: seed unused
    score_rollout(tr.reward, greedy)
    rollout.batch.greedy_scores = greedy.scores.repeat_interleave(tr.cfg.rollout.n)


def on_policy_update(cfg, step: int, rows: int, dp_size: int, dropout: float = 0.0) -> bool:
    """Whether this step's actor update is exactly on-policy, so that its own forward
    (detached) stands in for the old log-probs and the separate forward is skipped.

    True when the update is one optimizer step on this rank's ``rows`` rows under the
    weights that generated them: one epoch (``actor.ppo_epochs == 1``), one mini-batch
    (``rows <= actor.mini_batch_size / dp_size``), the actor updates this step (not a
    critic warm-up step), no dropout (``dropout``: the actor's largest rate; the old
    forward runs without it), and nothing needs policy log-probs before the update
    (``algorithm.kl_in_reward`` puts KL(policy || ref) in the token rewards).
    """
    a = cfg.actor
    critic_warmup = uses_critic(cfg) and step < cfg.critic.warmup_steps
    return (a.ppo_epochs == 1 and rows <= a.mini_batch_size // dp_size and not critic_warmup
            and dropout == 0.0 and not cfg.algorithm.kl_in_reward)


def _dropout(role) -> float:
    c = role.module.config
    return max(c.hidden_dropout, c.attention_dropout)


def forward_micro_batch(role_cfg) -> int:
    """Rows per forward-only micro-batch of the actor / critic section: its own setting, else the update's."""
    return role_cfg.forward_micro_batch_size or role_cfg.micro_batch_size


def prepare(tr, rollout) -> None:
    """Old log-probs (unless the update is on-policy), reference log-probs and values."""
    cfg, b = tr.cfg, rollout.batch
    micro = forward_micro_batch(cfg.actor)
    if not on_policy_update(cfg, tr.step, len(b), tr.groups.dp_size, _dropout(tr.actor)):
        with tr.timer("old_logprobs"):
            out = tr.actor.logprobs(b, micro, train_temperature(cfg), cfg.actor.max_tokens_per_micro)
            _set_old_logprobs(rollout, out)
    if tr.ref is not None:
        with tr.timer("ref_logprobs"):
            b.ref_logprobs = tr.ref.logprobs(b, micro, train_temperature(cfg), cfg.actor.max_tokens_per_micro)["logprobs"]
    if tr.critic is not None:
        with tr.timer("values"):
            b.values = tr.critic.values(b, forward_micro_batch(cfg.critic))


def _set_old_logprobs(rollout, out: dict) -> None:
    """Stores the policy's (B, L) log-probs under the generating weights; their metrics."""
    b = rollout.batch
    b.old_logprobs = out["logprobs"]
    _add(rollout.metrics, {"policy/entropy_sum": (out["entropy"] * b.response_mask).sum()})
    rollout.metrics.update(logprob_mismatch(rollout))


def advantages(tr, rollout) -> None:
    dp = tr.groups.dp if tr.groups.dp_size > 1 else None
    _add(rollout.metrics, compute_rollout_advantages(rollout, tr.cfg.algorithm, tr.kl_ctl.beta, dp))
    tr.metrics["kl/beta"] = tr.kl_ctl.beta
    if rollout.batch.old_logprobs is not None:  # else after the on-policy update
        _kl_metrics(tr, rollout)


def _kl_metrics(tr, rollout) -> None:
    """KL(policy || ref) under the old log-probs; the KL controller's update."""
    kl = kl_sum(rollout, tr.cfg.algorithm.kl_estimator)
    _add(rollout.metrics, {"kl/sum": kl})
    b = rollout.batch
    totals = tr.reduce({"kl/sum": kl, "kl/tokens": float(b.response_mask.sum()), "n": len(b)})
    tr.kl_ctl.update(totals["kl/sum"] / max(totals["kl/tokens"], 1.0), int(totals["n"]))


def _mini_batches(tr, n_rows: int, epoch: int) -> list[torch.Tensor]:
    """Shuffled index chunks of the per-rank mini-batch size, the same on every rank."""
    per_rank = tr.cfg.actor.mini_batch_size // tr.groups.dp_size
    gen = torch.Generator().manual_seed((tr.cfg.trainer.seed * 7919 + tr.step) * 31 + epoch)
    order = torch.randperm(n_rows, generator=gen)
    return [order[i:i + per_rank] for i in range(0, n_rows, per_rank)]


def _record_steps(tr, rollout, role: str, steps: list[dict]) -> None:
    """Averages grad norm and LR over the updates made; counts and guards the skipped ones;
    the DP token imbalance (max over mean of the ranks' tokens) is the worst update's."""
    made = sum(1 for s in steps if s["update_ok"])
    skipped = f"{role}/skipped_updates"
    tr.metrics[skipped] = tr.metrics.get(skipped, 0.0)
    for s in steps:
        ok, nonfinite, grad_norm, lr = (s.pop(k) for k in ("update_ok", "nonfinite", "grad_norm", "lr"))
        for key in ("dp_token_imbalance", "dp_token_imbalance_before", "oom_retries", "memory_divisor"):
            # the same on every rank: the max over the step's updates
            if key in s:
                tr.metrics[f"{role}/{key}"] = max(tr.metrics.get(f"{role}/{key}", 0.0), s.pop(key))
        for key in [k for k in s if k.startswith("moe/")]:  # expert load, the same on every rank: the worst update's
            tr.metrics[f"{role}/{key}"] = max(tr.metrics.get(f"{role}/{key}", 0.0), s.pop(key))
        if ok:
            tr.metrics[f"{role}/grad_norm"] = tr.metrics.get(f"{role}/grad_norm", 0.0) + grad_norm / made
            tr.metrics[f"{role}/lr"] = tr.metrics.get(f"{role}/lr", 0.0) + lr / made
        else:
            tr.metrics[skipped] += 1.0
        if ok or nonfinite:  # an fp16 loss-scale skip neither counts nor breaks a run of bad updates
            _guard_nonfinite(tr, role, bool(nonfinite))
        _add(rollout.metrics, s)


def _guard_nonfinite(tr, role: str, nonfinite: bool) -> None:
    """Counts non-finite updates in a row (the decision is the same on every rank); at
    ``trainer.max_bad_updates`` stops the run before anything is saved, so the last
    checkpoint is the last good one. The count starts at 0 again on resume."""
    if not nonfinite:
        tr.bad_updates[role] = 0
        return
    tr.bad_updates[role] = n = tr.bad_updates.get(role, 0) + 1
    limit = tr.cfg.trainer.max_bad_updates
    if dist.get_rank() == 0:
        print(f"step {tr.step + 1}: {role} update skipped (non-finite loss or gradient; {n} in a row)", flush=True)
    if limit and n >= limit:
        raise NonFiniteError(
            f"{role}: {n} optimizer updates in a row had a non-finite loss or gradient, the last at step "
            f"{tr.step + 1} (trainer.max_bad_updates={limit}); stopped without saving, the last checkpoint "
            f"in {tr.cfg.trainer.run_dir} is kept")


def update(tr, rollout) -> None:
    cfg, b = tr.cfg, rollout.batch
    on_policy = b.old_logprobs is None  # prepare skipped the old forward
    tr.metrics["perf/old_logprob_forward_skipped"] = float(on_policy)
    if tr.critic is not None:
        with tr.timer("critic_update"):
            for epoch in range(cfg.critic.ppo_epochs):
                steps = tr.critic.update(b, cfg.critic, _mini_batches(tr, len(b), epoch))
                _record_steps(tr, rollout, "critic", steps)
    if tr.critic is None or tr.step >= cfg.critic.warmup_steps:
        with tr.timer("actor_update"):
            if on_policy:
                _on_policy_actor_update(tr, rollout)
            else:
                for epoch in range(cfg.actor.ppo_epochs):
                    steps = tr.actor.update(b, cfg.actor, train_temperature(cfg), _mini_batches(tr, len(b), epoch),
                                            norm_len=cfg.rollout.max_new_tokens)
                    _record_steps(tr, rollout, "actor", steps)
    if on_policy:
        if b.old_logprobs is None:
            raise RuntimeError("the old forward was skipped but the actor did not update this step")
        _kl_metrics(tr, rollout)


def _on_policy_actor_update(tr, rollout) -> None:
    """The single optimizer step; its forward gives the old log-probs and their metrics."""
    cfg, b = tr.cfg, rollout.batch
    (index,) = _mini_batches(tr, len(b), 0)  # one mini-batch on this rank
    step, out = tr.actor.update_on_policy(b, cfg.actor, train_temperature(cfg), index,
                                          norm_len=cfg.rollout.max_new_tokens)
    _record_steps(tr, rollout, "actor", [step])
    _set_old_logprobs(rollout, out)


def _ratio(m: dict, num: str, den: str) -> float | None:
    if num in m and m.get(den, 0.0) > 0:
        return m[num] / m[den]
    return None


_RATIOS = (  # (metric, numerator, denominator) over DP-summed local sums
    ("response/length_mean", "response/length_sum", "response/count"),
    ("response/clip_ratio", "response/clipped", "response/count"),
    ("actor/pg_loss", "actor/pg_loss", "actor/count"),
    ("actor/clip_frac", "actor/clip_frac", "actor/tokens"),
    ("actor/approx_kl", "actor/approx_kl", "actor/tokens"),
    ("actor/dual_clip_frac", "actor/dual_clip_frac", "actor/tokens"),
    ("actor/kl_loss", "actor/kl_loss", "actor/tokens"),
    ("actor/entropy", "actor/entropy", "actor/tokens"),
    ("policy/entropy", "policy/entropy_sum", "mismatch/tokens"),
    ("critic/vf_loss", "critic/vf_loss", "critic/tokens"),
    ("critic/vf_clip_frac", "critic/vf_clip_frac", "critic/tokens"),
    ("kl/mean", "kl/sum", "kl/tokens"),
    ("mismatch/abs_mean", "mismatch/abs_sum", "mismatch/tokens"),
    ("advantage/mean", "advantage/sum", "kl/tokens"),
)


def _explained_variance(rollout) -> dict[str, float]:
    b, mask = rollout.batch, rollout.batch.response_mask
    if b.values is None:
        return {}
    real = mask != 0  # selected, not multiplied: a NaN at padding stays out of the sums
    r, err = torch.where(real, b.returns, 0.0), torch.where(real, b.returns - b.values, 0.0)
    return {"ev/r": r.sum(), "ev/r2": (r * r).sum(), "ev/e": err.sum(), "ev/e2": (err * err).sum()}


def _finish_explained_variance(m: dict) -> dict[str, float]:
    if "ev/r" not in m:
        return {}
    n = max(m["kl/tokens"], 1.0)
    var_r = m["ev/r2"] / n - (m["ev/r"] / n) ** 2
    var_e = m["ev/e2"] / n - (m["ev/e"] / n) ** 2
    return {"critic/explained_variance": 1.0 - var_e / var_r if var_r > 0 else 0.0}


def step_metrics(tr, rollout) -> dict[str, float]:
    """Everything logged for one step, identical on every rank."""
    _add(rollout.metrics, _explained_variance(rollout))
    rollout.metrics.pop("mismatch/abs_max", None)
    sums = tr.reduce(rollout.metrics)
    out = finish_score_metrics({k: v for k, v in sums.items() if k.startswith(("score/", "reward/"))})
    out.update({name: v for name, num, den in _RATIOS if (v := _ratio(sums, num, den)) is not None})
    out.update(_finish_explained_variance(sums))
    out.update(_maxima(tr, rollout))
    out.update(tr.metrics)
    out.update(tr.timer.metrics())
    seconds = time.perf_counter() - tr.step_start
    tokens = sums["response/length_sum"] + sums["prompt/length_sum"]
    world = dist.get_world_size()
    out.update({"perf/step_seconds": seconds, "perf/steps_per_min": 60.0 / seconds,
                "perf/tokens_per_s_per_gpu": tokens / seconds / world})
    if torch.cuda.is_available() and "perf/peak_memory_gb" not in out:  # else: the max over the phases
        out["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _maxima(tr, rollout) -> dict[str, float]:
    b = rollout.batch
    mismatch = b.rollout_logprobs - (b.old_logprobs if b.old_logprobs is not None else b.rollout_logprobs)
    t = torch.tensor([float(b.response_mask.sum(-1).max()), float((mismatch.abs() * b.response_mask).max())],
                     dtype=torch.float64)
    if tr.groups.dp_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tr.groups.dp)
    return {"response/length_max": float(t[0]), "mismatch/abs_max": float(t[1])}

"""The heavier phases of a PPO step, each taking what it reads as arguments.

:func:`prepare` (old / reference log-probs, values), :func:`advantages`, the
:class:`Updater`'s ``update`` (critic and actor optimizer steps, the guard against
non-finite updates) and :func:`step_metrics`. Metrics collected here are local
sums (``rollout.metrics``), reduced over DP in :func:`step_metrics`; values
already identical on every rank (grad norms, learning rates, beta) go to the
step's ``metrics`` dict, which the trainer owns.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.algos import AdaptiveKLController, FixedKLController
from megarl.config import AlgorithmConfig, Config
from megarl.config_checks import uses_critic
from megarl.distributed import ParallelGroups
from megarl.errors import NonFiniteError
from megarl.trainer.advantage import compute_rollout_advantages, kl_sum, logprob_mismatch
from megarl.trainer.metrics import PhaseTimer, dp_sum
from megarl.trainer.replay_metrics import probe_without_replay, require_expert_ids
from megarl.trainer.rollout import Rollout
from megarl.trainer.scoring import finish_score_metrics

if TYPE_CHECKING:  # annotations only: the roles pull in megatron-core
    from megarl.roles.policy import Policy
    from megarl.roles.value import Critic

KLController = AdaptiveKLController | FixedKLController


def _add(metrics: dict, values: dict) -> None:
    for k, v in values.items():
        metrics[k] = metrics.get(k, 0.0) + float(v)


def _dp(groups: ParallelGroups):
    """The DP group to reduce over; None with one DP rank."""
    return groups.dp if groups.dp_size > 1 else None


def train_temperature(cfg) -> float:
    """Log-probs are taken under the sampling temperature (1 for greedy)."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


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


def prepare(rollout: Rollout, cfg: Config, step: int, dp_size: int, actor: Policy, ref: Policy | None,
            critic: Critic | None, timer: PhaseTimer) -> dict[str, float]:
    """Old log-probs (unless the update of step ``step`` is on-policy), reference log-probs and values,
    into ``rollout.batch``. Returns values the same on every rank: with router replay, its metrics
    (megarl/trainer/replay_metrics.py)."""
    b = rollout.batch
    micro = forward_micro_batch(cfg.actor)
    old = lambda: actor.logprobs(b, micro, train_temperature(cfg), cfg.actor.max_tokens_per_micro)  # noqa: E731
    same = {}
    if actor.replay is not None:
        require_expert_ids(b)
        with timer("no_replay_probe"):
            same.update(probe_without_replay(b, actor, step, cfg.actor.router_replay_probe_every, old))
    if not on_policy_update(cfg, step, len(b), dp_size, _dropout(actor)):
        with timer("old_logprobs"):
            _set_old_logprobs(rollout, old())
        if actor.replay is not None:
            same.update(actor.replay.read())
    if ref is not None:
        with timer("ref_logprobs"):
            b.ref_logprobs = ref.logprobs(b, micro, train_temperature(cfg), cfg.actor.max_tokens_per_micro)["logprobs"]
    if critic is not None:
        with timer("values"):
            b.values = critic.values(b, forward_micro_batch(cfg.critic))
    return same


def _set_old_logprobs(rollout, out: dict) -> None:
    """Stores the policy's (B, L) log-probs under the generating weights; their metrics."""
    b = rollout.batch
    b.old_logprobs = out["logprobs"]
    _add(rollout.metrics, {"policy/entropy_sum": (out["entropy"] * b.response_mask).sum()})
    rollout.metrics.update(logprob_mismatch(rollout))


def advantages(rollout: Rollout, algo: AlgorithmConfig, kl_ctl: KLController, groups: ParallelGroups) -> dict:
    """Advantages and returns into ``rollout.batch``; with old log-probs, the KL metrics and the KL
    controller's update. Returns the step's ``kl/beta`` (the coefficient these rewards used)."""
    beta = kl_ctl.beta
    _add(rollout.metrics, compute_rollout_advantages(rollout, algo, beta, _dp(groups)))
    if rollout.batch.old_logprobs is not None:  # else after the on-policy update
        kl_metrics(rollout, algo.kl_estimator, kl_ctl, groups)
    return {"kl/beta": beta}


def kl_metrics(rollout: Rollout, estimator: str, kl_ctl: KLController, groups: ParallelGroups) -> None:
    """KL(policy || ref) under the old log-probs; the KL controller's update."""
    kl = kl_sum(rollout, estimator)
    _add(rollout.metrics, {"kl/sum": kl})
    b = rollout.batch
    totals = dp_sum({"kl/sum": kl, "kl/tokens": float(b.response_mask.sum()), "n": len(b)}, _dp(groups))
    kl_ctl.update(totals["kl/sum"] / max(totals["kl/tokens"], 1.0), int(totals["n"]))


class Updater:
    """The critic and actor updates of a run, and its count of non-finite updates in a row per role
    (``trainer.max_bad_updates``; the count starts at 0 again on resume)."""

    def __init__(self, cfg: Config, actor: Policy, critic: Critic | None, kl_ctl: KLController,
                 groups: ParallelGroups):
        self.cfg, self.actor, self.critic, self.kl_ctl, self.groups = cfg, actor, critic, kl_ctl, groups
        self.bad_updates: dict[str, int] = {}  # role -> optimizer updates skipped in a row (non-finite)

    def update(self, rollout: Rollout, step: int, timer: PhaseTimer, metrics: dict[str, float]) -> None:
        """Step ``step``'s critic epochs, then (past the critic's warm-up) the actor's; grad norms, LRs and
        skipped updates into ``metrics``."""
        cfg, b = self.cfg, rollout.batch
        on_policy = b.old_logprobs is None  # prepare skipped the old forward
        metrics["perf/old_logprob_forward_skipped"] = float(on_policy)
        if self.critic is not None:
            with timer("critic_update"):
                for epoch in range(cfg.critic.ppo_epochs):
                    steps = self.critic.update(b, cfg.critic, self._mini_batches(len(b), step, epoch))
                    self.record(rollout, "critic", steps, step, metrics)
        if self.critic is None or step >= cfg.critic.warmup_steps:
            with timer("actor_update"):
                if on_policy:
                    self._on_policy_actor_update(rollout, step, metrics)
                else:
                    for epoch in range(cfg.actor.ppo_epochs):
                        steps = self.actor.update(b, cfg.actor, train_temperature(cfg),
                                                  self._mini_batches(len(b), step, epoch),
                                                  norm_len=cfg.rollout.max_new_tokens)
                        self.record(rollout, "actor", steps, step, metrics)
        if on_policy:
            if b.old_logprobs is None:
                raise RuntimeError("the old forward was skipped but the actor did not update this step")
            kl_metrics(rollout, cfg.algorithm.kl_estimator, self.kl_ctl, self.groups)

    def _on_policy_actor_update(self, rollout: Rollout, step: int, metrics: dict[str, float]) -> None:
        """The single optimizer step; its forward gives the old log-probs and their metrics."""
        cfg, b = self.cfg, rollout.batch
        (index,) = self._mini_batches(len(b), step, 0)  # one mini-batch on this rank
        if self.actor.replay is not None:
            self.actor.replay.reset()  # the agreement of this forward, under the weights that generated
        made, out = self.actor.update_on_policy(b, cfg.actor, train_temperature(cfg), index,
                                                norm_len=cfg.rollout.max_new_tokens)
        if self.actor.replay is not None:
            metrics.update(self.actor.replay.read())
        self.record(rollout, "actor", [made], step, metrics)
        _set_old_logprobs(rollout, out)

    def _mini_batches(self, n_rows: int, step: int, epoch: int) -> list[torch.Tensor]:
        """Shuffled index chunks of the per-rank mini-batch size, the same on every rank."""
        per_rank = self.cfg.actor.mini_batch_size // self.groups.dp_size
        gen = torch.Generator().manual_seed((self.cfg.trainer.seed * 7919 + step) * 31 + epoch)
        order = torch.randperm(n_rows, generator=gen)
        return [order[i:i + per_rank] for i in range(0, n_rows, per_rank)]

    def record(self, rollout: Rollout, role: str, steps: list[dict], step: int, metrics: dict[str, float]) -> None:
        """Averages grad norm and LR over the updates made (into ``metrics``); counts and guards the
        skipped ones; the DP token imbalance (max over mean of the ranks' tokens) is the worst update's;
        the rest of each update's values are local sums into ``rollout.metrics``."""
        made = sum(1 for s in steps if s["update_ok"])
        skipped = f"{role}/skipped_updates"
        metrics[skipped] = metrics.get(skipped, 0.0)
        for s in steps:
            ok, nonfinite, grad_norm, lr = (s.pop(k) for k in ("update_ok", "nonfinite", "grad_norm", "lr"))
            for key in ("dp_token_imbalance", "dp_token_imbalance_before", "oom_retries", "memory_divisor"):
                # the same on every rank: the max over the step's updates
                if key in s:
                    metrics[f"{role}/{key}"] = max(metrics.get(f"{role}/{key}", 0.0), s.pop(key))
            if "memory_before_step_gb" in s:  # a machine reading, with the phases' memory/: the step's max
                name = f"memory/{role}_before_step_gb"
                metrics[name] = max(metrics.get(name, 0.0), s.pop("memory_before_step_gb"))
            for key in [k for k in s if k.startswith("moe/")]:  # expert load, the same on every rank: the worst update's
                metrics[f"{role}/{key}"] = max(metrics.get(f"{role}/{key}", 0.0), s.pop(key))
            if ok:
                metrics[f"{role}/grad_norm"] = metrics.get(f"{role}/grad_norm", 0.0) + grad_norm / made
                metrics[f"{role}/lr"] = metrics.get(f"{role}/lr", 0.0) + lr / made
            else:
                metrics[skipped] += 1.0
            if ok or nonfinite:  # an fp16 loss-scale skip neither counts nor breaks a run of bad updates
                self._guard_nonfinite(role, bool(nonfinite), step)
            _add(rollout.metrics, s)

    def _guard_nonfinite(self, role: str, nonfinite: bool, step: int) -> None:
        """Counts non-finite updates in a row (the decision is the same on every rank); at
        ``trainer.max_bad_updates`` stops the run before anything is saved, so the last
        checkpoint is the last good one."""
        if not nonfinite:
            self.bad_updates[role] = 0
            return
        self.bad_updates[role] = n = self.bad_updates.get(role, 0) + 1
        t = self.cfg.trainer
        if dist.get_rank() == 0:
            print(f"step {step + 1}: {role} update skipped (non-finite loss or gradient; {n} in a row)", flush=True)
        if t.max_bad_updates and n >= t.max_bad_updates:
            raise NonFiniteError(
                f"{role}: {n} optimizer updates in a row had a non-finite loss or gradient, the last at step "
                f"{step + 1} (trainer.max_bad_updates={t.max_bad_updates}); stopped without saving, the last "
                f"checkpoint in {t.run_dir} is kept")


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


def step_metrics(rollout: Rollout, groups: ParallelGroups, metrics: dict[str, float], timer: PhaseTimer,
                 start: float) -> dict[str, float]:
    """Everything logged for one step, identical on every rank: ``rollout``'s local sums reduced over DP,
    the step's same-on-every-rank ``metrics``, its phase times, and throughput since ``start``
    (``time.perf_counter``)."""
    _add(rollout.metrics, _explained_variance(rollout))
    rollout.metrics.pop("mismatch/abs_max", None)
    sums = dp_sum(rollout.metrics, _dp(groups))
    out = finish_score_metrics({k: v for k, v in sums.items() if k.startswith(("score/", "reward/"))})
    out.update({name: v for name, num, den in _RATIOS if (v := _ratio(sums, num, den)) is not None})
    out.update(_finish_explained_variance(sums))
    out.update(_maxima(rollout, groups))
    out.update(metrics)
    out.update(timer.metrics())
    seconds = time.perf_counter() - start
    tokens = sums["response/length_sum"] + sums["prompt/length_sum"]
    world = dist.get_world_size()
    out.update({"perf/step_seconds": seconds, "perf/steps_per_min": 60.0 / seconds,
                "perf/tokens_per_s_per_gpu": tokens / seconds / world})
    if torch.cuda.is_available() and "perf/peak_memory_gb" not in out:  # else: the max over the phases
        out["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _maxima(rollout: Rollout, groups: ParallelGroups) -> dict[str, float]:
    b = rollout.batch
    mismatch = b.rollout_logprobs - (b.old_logprobs if b.old_logprobs is not None else b.rollout_logprobs)
    t = torch.tensor([float(b.response_mask.sum(-1).max()), float((mismatch.abs() * b.response_mask).max())],
                     dtype=torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.dp)
    return {"response/length_max": float(t[0]), "mismatch/abs_max": float(t[1])}

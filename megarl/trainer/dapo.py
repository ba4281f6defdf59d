"""DAPO in the loop: dynamic sampling over generation rounds, overlong shaping, truncated responses masked.

Dynamic sampling (``algorithm.dapo.dynamic_sampling``): each round draws this
rank's next ``data.batch_size / dp`` prompts, generates and scores them, and
keeps the groups whose scores differ (:func:`megarl.algos.dapo.informative_groups`)
until the rank holds ``data.batch_size / dp`` of them; surplus informative
groups of the last round are dropped. The ranks run the same number of rounds
(they agree after each one whether any rank is still short): a rank already
full draws the round's prompts, so every rank's sampler stays at the same
position, but generates nothing. After ``max_rounds`` a rank still short fills
its batch with the uninformative groups it dropped (``dapo/groups_filled``), so
every rank trains on as many rows as without dynamic sampling.

Round 0 uses the step's seed, so a step whose groups are all informative is the
step without dynamic sampling. Score metrics cover every generated sample (an
honest learning curve); the trained batch is the filtered one.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from megarl.algos.dapo import informative_groups, overlong_penalty
from megarl.trainer.metrics import dp_sum
from megarl.trainer.rollout import Rollout, concat_rollouts, select_rollout
from megarl.trainer.scoring import score_metrics, score_rollout

ROUND_SEED_STRIDE = 7_919_000_003  # round k samples from the step's seed + k * this (far from other steps' seeds)
COUNTS = ("groups_generated", "groups_informative", "groups_kept", "groups_filled", "groups_dropped")


def response_lengths(rollout: Rollout) -> torch.Tensor:
    """(B,) response tokens of each row as the engine counts them against max_new_tokens (sampled and
    appended): total length minus the prompt, the prompt ending where the response mask first is 1."""
    b = rollout.batch
    real = b.response_mask != 0  # (B, L)
    first = torch.where(real.any(-1), real.float().argmax(-1), b.lengths)  # (B,)
    return b.lengths - first


def shape_scores(rollout: Rollout, dapo, max_new_tokens: int) -> dict[str, float]:
    """Adds the overlong penalty to ``rollout.scores`` (``dapo.overlong_buffer`` > 0); its local sum."""
    if dapo.overlong_buffer <= 0:
        return {}
    penalty = overlong_penalty(response_lengths(rollout), max_new_tokens, dapo.overlong_buffer, dapo.overlong_penalty)
    rollout.scores = rollout.scores + penalty.to(rollout.scores.dtype)
    return {"reward/overlong_sum": float(penalty.sum())}


def score_and_shape(reward, rollout: Rollout, dapo, max_new_tokens: int) -> dict[str, float]:
    """Scores the rollout, adds the overlong penalty; its metrics (score/* of the shaped scores)."""
    metrics = score_rollout(reward, rollout)
    if dapo.overlong_buffer > 0:
        metrics.update(shape_scores(rollout, dapo, max_new_tokens))
        metrics.update(score_metrics(rollout.scores))
    return metrics


def mask_truncated(rollout: Rollout) -> None:
    """Responses cut at the length limit (finish reason "length") get an all-zero loss mask."""
    cut = torch.tensor([f == "length" for f in rollout.finish_reasons], device=rollout.batch.response_mask.device)
    rollout.batch.response_mask = torch.where(cut[:, None], 0.0, rollout.batch.response_mask)


def fill_batch(draw: Callable[[int, bool], Optional[Rollout]], quota: int, max_rounds: int,
               any_short: Callable[[bool], bool] = lambda short: short) -> tuple[Rollout, dict[str, float]]:
    """Informative groups from rounds ``draw(k, wanted)`` until ``quota`` groups are held.

    ``draw`` consumes round k's prompts and returns them generated and scored when
    ``wanted``, else None. ``any_short(short)`` says whether any rank is still short
    (a collective: every rank calls it once per round after the first). Returns the
    batch (kept groups in the order drawn, then fill) and this rank's counts."""
    kept, spare = [], []  # (rollout, rows) per group
    counts = dict.fromkeys(COUNTS, 0.0)
    rounds = 0
    while rounds < max_rounds and (rounds == 0 or any_short(len(kept) < quota)):
        r = draw(rounds, len(kept) < quota)
        rounds += 1
        if r is None:
            continue
        for rows, informative in informative_groups(r.scores, r.group_ids):
            counts["groups_generated"] += 1
            counts["groups_informative"] += informative
            if informative and len(kept) < quota:
                kept.append((r, rows))
            elif not informative:
                spare.append((r, rows))
    fill = spare[:quota - len(kept)]
    chosen = kept + fill
    counts["groups_kept"], counts["groups_filled"] = float(len(kept)), float(len(fill))
    counts["groups_dropped"] = counts["groups_generated"] - len(chosen)
    counts["rounds"] = float(rounds)
    return concat_rollouts([select_rollout(r, rows) for r, rows in chosen]), counts


def any_rank_short(short: bool, dp_group) -> bool:
    """Whether any rank of ``dp_group`` is short (None: this rank alone)."""
    return dp_sum({"short": float(short)}, dp_group)["short"] > 0


def dapo_counts(counts: dict[str, float], dp_group) -> dict[str, float]:
    """``dapo/<count>`` summed over ``dp_group`` (rounds: the same on every rank, kept as is)."""
    out = {f"dapo/{k}": v for k, v in dp_sum({k: counts[k] for k in COUNTS}, dp_group).items()}
    out["dapo/rounds"] = counts["rounds"]
    return out


def sample_until_full(cfg, reward, next_prompts: Callable[[], list], generate: Callable[[list, int], Rollout],
                      seed: int, dp_size: int, dp_group, timer=None) -> tuple[Rollout, dict[str, float]]:
    """One step's batch by dynamic sampling (module docstring), scored and shaped, and the dapo/*
    counts of the whole batch (summed over ``dp_group``, the ranks that agree on the rounds).

    ``next_prompts()`` draws this rank's next prompts; ``generate(prompts, seed)`` samples them;
    round k uses ``seed + k * ROUND_SEED_STRIDE``. The score metrics of every generated sample go to
    the returned rollout's metrics. The synchronous trainer and the asynchronous rollout ranks both
    build their batches here."""
    d, scored = cfg.algorithm.dapo, {}

    def draw(k: int, wanted: bool) -> Optional[Rollout]:
        prompts = next_prompts()
        if not wanted:
            return None
        rollout = generate(prompts, seed + k * ROUND_SEED_STRIDE)
        with timer("reward") if timer is not None else contextlib.nullcontext():
            for key, value in score_and_shape(reward, rollout, d, cfg.rollout.max_new_tokens).items():
                cumulative = key == "reward/cache/fallbacks"  # since the start; hits and misses are per call
                scored[key] = value if cumulative else scored.get(key, 0.0) + value
        return rollout

    rollout, counts = fill_batch(draw, cfg.data.batch_size // dp_size, d.max_rounds,
                                 lambda short: any_rank_short(short, dp_group))
    rollout.metrics.update(scored)
    return rollout, dapo_counts(counts, dp_group)


def dynamic_sampling_rollout(tr) -> Rollout:
    """The synchronous trainer's batch by :func:`sample_until_full`; its dapo/* counts go to ``tr.metrics``."""
    dp = tr.groups.dp if tr.groups.dp_size > 1 else None
    rollout, counts = sample_until_full(tr.cfg, tr.reward, lambda: tr.sampler.next_batch(tr.train_set),
                                        tr.generate_prompts, tr.sampling_seed(), tr.groups.dp_size, dp, tr.timer)
    tr.metrics.update(counts)
    return rollout

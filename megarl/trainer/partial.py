"""Partial rollouts (``rollout.partial``): a step trains the first whole groups to finish; the rest carry over.

Each DP rank keeps its own groups in flight (a group: one prompt and its ``rollout.n``
samples). A step

1. tops up: draws batches of prompts (the sampler's next ``data.batch_size / dp``) while
   another batch fits under ``rollout.partial_batches`` batches' worth of groups in flight;
   the k-th batch drawn in a step samples from the step's seed + k * ``SEED_STRIDE``;
2. generates every unfinished sample with the native engine's ``generate_until``, each
   resumed from the tokens it has (prefilled again under the current weights; its earlier
   K/V is not kept, see :mod:`megarl.rollout.native`), and stops once ``quota`` groups are
   complete (every sample finished), groups already complete counted;
3. trains the ``quota`` complete groups drawn first (the oldest); unfinished samples and
   complete groups beyond the quota wait for the next step.

Groups enter whole for every advantage estimator (for group advantages they must; for
the others it costs nothing). Every response token keeps the policy version that
sampled it (trainer steps of those weights: ``SampleBatch.token_versions``) and its
rollout log-prob under that policy, so ``algorithm.rollout_correction`` weighs each
token's ratio pi_old / pi_roll whether it is stale or not (``preset=async`` is made for it).
With ``actor.router_replay=r3`` each position also keeps the experts that routed it in the
call that first computed it (:mod:`megarl.rollout.expert_record`): the prompt's and the
earlier tokens' under the policy that sampled them, the new tokens' under the new one.

What is in flight is saved with every checkpoint (one file per rank), so a resumed run
continues the same responses bit for bit; a resume that cannot read them (another
layout, a checkpoint of a run without partial rollouts) starts with none and says how
many were lost in ``partial/dropped_on_resume``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megarl.data.dataset import PromptBatch, PromptItem
from megarl.models.router_replay import all_stage_layers
from megarl.rollout.engine import GenerationResult, Request, SamplingParams, sample_requests
from megarl.rollout.expert_record import merge, positions, split
from megarl.trainer.metrics import dp_sum
from megarl.trainer.rollout import Rollout, pack_rollout

SEED_STRIDE = 7_919_000_017  # batch k drawn in a step samples from the step's seed + k * this
PREFIX = "partial/"


@dataclass
class Sample:
    """One response in flight: its seed and what it sampled so far, token by token."""

    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's, under the policy that sampled it
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each token
    finish: str | None = None  # "stop" | "length" once done
    # MoE, recorded: (prompt + tokens - 1, layers, k) expert ids per position, each token's from the call
    # that sampled it (megarl/rollout/expert_record.py); None: nothing recorded
    experts: np.ndarray | None = None


@dataclass
class Group:
    """A prompt and its samples; complete when every sample is done."""

    item: PromptItem
    order: int  # when this rank drew it: smaller is older
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)


class PartialRollouts:
    """The groups one rank has in flight, and how a step generates and takes them."""

    def __init__(self, quota: int, n: int, batches: int, max_new_tokens: int, dp_rank: int = 0):
        self.quota, self.n, self.batches, self.max_new_tokens = quota, n, batches, max_new_tokens
        self.dp_rank = dp_rank
        self.groups: list[Group] = []
        self.drawn = 0  # groups drawn so far on this rank (Group.order)
        self.dropped = 0  # responses a resume could not restore (reported once)
        self.restarted = 0  # responses begun too long ago, sampled again from their seed (async; reported once)

    # -- a step ---------------------------------------------------------------
    def top_up(self, draw: Callable[[], PromptBatch], seed: int) -> int:
        """Draws batches while one more fits under ``batches`` batches of groups; returns how many."""
        k = 0
        while len(self.groups) + self.quota <= self.batches * self.quota:
            prompts = draw()
            requests = sample_requests(prompts.prompt_ids, self.n, seed + k * SEED_STRIDE, self.max_new_tokens)
            for i, item in enumerate(prompts.items):
                seeds = [r.seed for r in requests[i * self.n:(i + 1) * self.n]]
                self.groups.append(Group(item, self.drawn, [Sample(s) for s in seeds]))
                self.drawn += 1
            k += 1
        return k

    def generate(self, engine, params: SamplingParams, version: int) -> bool:
        """Advances the unfinished samples until ``quota`` groups are complete; new tokens get ``version``.
        False when nothing had to run (enough groups were complete already)."""
        left = {gi: sum(s.finish is None for s in g.samples) for gi, g in enumerate(self.groups)}
        complete = [sum(count == 0 for count in left.values())]
        requests = [Request(gi * self.n + j, list(g.item.prompt_ids), s.seed, self.max_new_tokens,
                            prefix=tuple(s.tokens), prefix_logprobs=tuple(s.logprobs))
                    for gi, g in enumerate(self.groups) for j, s in enumerate(g.samples) if s.finish is None]
        if complete[0] >= self.quota or not requests:
            return False

        def enough(keys: list[int]) -> bool:
            for key in keys:
                left[key // self.n] -= 1
                complete[0] += left[key // self.n] == 0
            return complete[0] >= self.quota

        finished, unfinished = engine.generate_until(requests, params, enough)
        for r in finished + unfinished:
            sample = self.groups[r.key // self.n].samples[r.key % self.n]
            sample.versions += [version] * (len(r.response_ids) - len(sample.tokens))
            sample.tokens, sample.logprobs = list(r.response_ids), list(r.logprobs)
            sample.experts = merge(sample.experts, positions(r))  # earlier tokens keep their policy's ids
            sample.finish = None if r.finish_reason == "unfinished" else r.finish_reason
        return True

    def restart_older_than(self, oldest: int) -> int:
        """Samples with a token older than version ``oldest`` start over (same seed, no tokens); how many.
        trainer.mode=async bounds every token's age this way (:mod:`megarl.trainer.async_rollout`)."""
        stale = [s for g in self.groups for s in g.samples if s.versions and min(s.versions) < oldest]
        for s in stale:
            s.tokens, s.logprobs, s.versions, s.finish, s.experts = [], [], [], None, None
        self.restarted += len(stale)
        return len(stale)

    def take(self) -> list[Group]:
        """The ``quota`` oldest complete groups (fewer if fewer are), removed from flight."""
        chosen = sorted((g for g in self.groups if g.complete), key=lambda g: g.order)[:self.quota]
        taken = {id(g) for g in chosen}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return chosen

    # -- checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "shape": [self.quota, self.n, self.max_new_tokens], "dp_rank": self.dp_rank,
                "groups": [{"item": asdict(g.item), "order": g.order, "samples": [asdict(s) for s in g.samples]}
                           for g in self.groups]}

    def load_state_dict(self, state: dict | None) -> None:
        """Restores what was in flight; None (nothing readable) or another batch shape drops it, counted."""
        if state is None or state["shape"] != [self.quota, self.n, self.max_new_tokens]:
            self.dropped = sum(len(g["samples"]) for g in state["groups"]) if state else 0
            self.groups = []
            return
        self.drawn = state["drawn"]
        self.groups = [Group(PromptItem(**g["item"]), g["order"], [Sample(**s) for s in g["samples"]])
                       for g in state["groups"]]


def restore(p: PartialRollouts, checkpointer, step: int, rank0: bool) -> None:
    """What was in flight at ``step``: this rank's own file; after a change of layout (no file of this
    rank's) nothing, rank 0 counting the responses of every saved data-parallel rank as dropped."""
    mine = checkpointer.read_rank_file(step, "partial")
    p.load_state_dict(mine)
    if mine is None and rank0:
        saved = {s["dp_rank"]: s for s in checkpointer.read_rank_files(step, "partial")}  # TP / PP copies once
        p.dropped = sum(len(g["samples"]) for s in saved.values() for g in s["groups"])


def group_results(groups: list[Group]) -> list[GenerationResult]:
    """One result per sample, grouped by prompt, each with its per-token versions (and recorded experts)."""
    out = []
    for gi, g in enumerate(groups):
        for j, s in enumerate(g.samples):
            prompt_experts, experts = split(s.experts, len(g.item.prompt_ids), len(s.tokens))
            out.append(GenerationResult(list(g.item.prompt_ids), s.tokens, s.logprobs, s.finish,
                                        gi * len(g.samples) + j, versions=s.versions, expert_ids=experts,
                                        prompt_expert_ids=prompt_experts))
    return out


def local_sums(taken: list[Group], flight: list[Group], version: int) -> dict[str, float]:
    """This rank's counts: trained responses begun by an older policy, their ages (``version`` minus their
    first token's version), tokens by older policies, and responses carried to the next step."""
    trained = [s for g in taken for s in g.samples]
    ages = [version - min(s.versions) for s in trained if s.versions]
    carried = [s for g in flight for s in g.samples]
    return {"responses": float(len(trained)), "resumed": float(sum(a > 0 for a in ages)),
            "age_sum": float(sum(ages)), "tokens": float(sum(len(s.versions) for s in trained)),
            "stale_tokens": float(sum(v < version for s in trained for v in s.versions)),
            "carried_over": float(len(carried)), "carried_unfinished": float(sum(s.finish is None for s in carried))}


def partial_metrics(sums: dict[str, float], age_max: float, dropped: int, dp_group,
                    restarted: int = 0) -> dict[str, float]:
    """The step's ``partial/*`` metrics over every DP rank (identical on every rank)."""
    total = dp_sum({**sums, "dropped": float(dropped), "restarted": float(restarted)}, dp_group)
    peak = torch.tensor([age_max], dtype=torch.float64)
    if dp_group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=dp_group)
    out = {f"{PREFIX}{k}": total[k] for k in ("carried_over", "carried_unfinished", "resumed")}
    out.update({f"{PREFIX}age_mean": total["age_sum"] / max(total["responses"], 1.0),
                f"{PREFIX}age_max": float(peak[0]),
                f"{PREFIX}stale_token_frac": total["stale_tokens"] / max(total["tokens"], 1.0)})
    if total["dropped"]:
        out[f"{PREFIX}dropped_on_resume"] = total["dropped"]
    if total["restarted"]:
        out[f"{PREFIX}restarted_stale"] = total["restarted"]
    return out


def partial_rollout(tr) -> Rollout:
    """This step's batch from the rank's groups in flight (module docstring); ``partial/*`` metrics go to
    ``tr.metrics``. ``tr`` is the trainer (its engine, sampler, data, step and timer)."""
    with tr.timer("rollout"):
        taken = generate_and_take(tr.partial, tr.engine, lambda: tr.sampler.next_batch(tr.train_set),
                                  tr.sampling_params(), tr.sampling_seed(), tr.step)
    dp = tr.groups.dp if tr.groups.dp_size > 1 else None
    rollout, metrics = pack_taken(tr.partial, taken, tr.step, tr.tokenizer, tr.pad_id, tr.device, dp)
    rollout.batch.expert_ids = all_stage_layers(rollout.batch.expert_ids, tr.groups)  # MoE: every stage's layers
    tr.metrics.update(metrics)
    return rollout


def generate_and_take(p: PartialRollouts, engine, draw: Callable[[], PromptBatch], params: SamplingParams,
                      seed: int, version: int) -> list[Group]:
    """Tops up from ``draw`` (seeded from ``seed``), generates with the weights of ``version`` until the
    quota is complete, and takes the oldest complete groups."""
    p.top_up(draw, seed)
    engine.resume_memory()
    if not p.generate(engine, params, version):
        engine.stats = {}  # no engine call this step: no counters (not the last call's)
    engine.release_memory()
    return p.take()


def pack_taken(p: PartialRollouts, taken: list[Group], step: int, tokenizer, pad_id: int, device,
               dp_group) -> tuple[Rollout, dict[str, float]]:
    """The batch of training step ``step`` from ``taken`` (its policy_version: the oldest token's) and the
    step's ``partial/*`` metrics (ages counted from ``step``; the same on every DP rank)."""
    if len(taken) < p.quota:
        raise RuntimeError(f"partial rollouts: {len(taken)} complete groups for a batch of {p.quota}")
    rollout = pack_rollout(group_results(taken), [g.item for g in taken for _ in g.samples], tokenizer, pad_id,
                           device)
    rollout.batch.policy_version = min(v for g in taken for s in g.samples for v in s.versions)
    sums = local_sums(taken, p.groups, step)
    age_max = max(step - min(s.versions) for g in taken for s in g.samples)
    metrics = partial_metrics(sums, float(age_max), p.dropped, dp_group, p.restarted)
    p.dropped = p.restarted = 0
    return rollout, metrics

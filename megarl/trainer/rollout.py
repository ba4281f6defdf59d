"""Prompts -> engine -> a :class:`Rollout`: token batch plus the texts rewards read."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.data import PromptBatch
from megarl.models.router_replay import batch_expert_ids, pad_positions
from megarl.roles.batch import PER_SEQUENCE, PER_TOKEN, SampleBatch, cat_rows
from megarl.rollout.engine import GenerationResult, RolloutEngine, SamplingParams, sample_requests


@dataclass
class Rollout:
    """One DP rank's samples of one step (n per prompt, grouped by prompt)."""

    batch: SampleBatch
    prompts: list[str]
    responses: list[str]
    answers: list
    extras: list[dict]
    group_ids: torch.Tensor  # (B,) dataset index of the prompt
    finish_reasons: list[str]
    scores: torch.Tensor | None = None  # (B,)
    metrics: dict[str, float] = field(default_factory=dict)


def to_sample_batch(results: list[GenerationResult], pad_id: int, device) -> SampleBatch:
    """Right-padded prompt+response ids, response mask and rollout log-probs, (B, L); the policy version
    of each response token when the results carry them (partial rollouts).

    The response mask is each result's loss mask: 1 at tokens the model sampled, 0 at
    appended context (tool results, user turns) inside a multi-turn response, which
    therefore gets no loss, no advantage and no KL."""
    seqs = [r.prompt_ids + r.response_ids for r in results]
    width = max(len(s) for s in seqs)
    batch = len(results)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, width)
    rollout_lp = torch.zeros(batch, width)
    for i, r in enumerate(results):
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids[i, : p + n] = torch.tensor(seqs[i])
        mask[i, p : p + n] = 1.0 if r.loss_mask is None else torch.tensor(r.loss_mask, dtype=mask.dtype)
        rollout_lp[i, p : p + n] = torch.tensor(r.logprobs)
    lengths = torch.tensor([len(s) for s in seqs])
    experts = batch_expert_ids(results, width)  # MoE, recorded: (B, L, layers of this stage, k)
    batch = SampleBatch(ids.to(device), mask.to(device), lengths.to(device), rollout_logprobs=rollout_lp.to(device),
                        expert_ids=None if experts is None else experts.to(device))
    if any(r.versions is not None for r in results):  # partial rollouts: who sampled each token
        versions = torch.zeros(len(results), width, dtype=torch.long)
        for i, r in enumerate(results):
            p = len(r.prompt_ids)
            versions[i, p : p + len(r.versions)] = torch.tensor(r.versions, dtype=torch.long)
        batch.token_versions = versions.to(device)
    return batch


def generate_rollout(engine: RolloutEngine, prompts: PromptBatch, params: SamplingParams, tokenizer,
                     pad_id: int, device, *, n: int, seed: int, max_new_tokens: int) -> Rollout:
    """Generates and packs one step's samples: ``n`` requests per prompt from ``seed``
    (:func:`~megarl.rollout.engine.sample_requests`), each result back to its prompt by key (``key // n``).
    A multi-turn result (``extra["trajectory"]``, from :class:`~megarl.rollout.agent.AgentLoop`) gives
    rewards its last assistant turn as the response and the whole conversation as ``extra["trajectory"]``."""
    bind_items(engine, {k: prompts.items[k // n] for k in range(len(prompts.items) * n)})
    results = engine.generate(sample_requests(prompts.prompt_ids, n, seed, max_new_tokens), params)
    return pack_rollout(results, [prompts.items[r.key // n] for r in results], tokenizer, pad_id, device)


def pack_rollout(results: list[GenerationResult], items: list, tokenizer, pad_id: int, device) -> Rollout:
    """A :class:`Rollout` of ``results``, row i answering dataset row ``items[i]`` (its texts, answer,
    extra fields and group id)."""
    return Rollout(
        batch=to_sample_batch(results, pad_id, device),
        prompts=[it.prompt_text for it in items],
        responses=tokenizer.batch_decode([r.extra.get("final_turn_ids", r.response_ids) for r in results],
                                         skip_special_tokens=True),
        answers=[it.answer for it in items],
        extras=[{**it.extra, **{k: r.extra[k] for k in _CARRIED if k in r.extra}} for it, r in zip(items, results)],
        group_ids=torch.tensor([it.index for it in items], device=device),
        finish_reasons=[r.finish_reason for r in results],
    )


def bind_items(engine, items: dict) -> None:
    """Engines that hand samples to agents (``rollout.server``) get each request key's dataset row."""
    if hasattr(engine, "bind_items"):
        engine.bind_items({k: {"messages": it.messages, "answer": it.answer, "extra": it.extra}
                           for k, it in items.items()})


_CARRIED = ("trajectory", "agent_reward", "agent_failed")  # result fields rewards read (multi-turn, rollout.server)
_TEXTS = ("prompts", "responses", "answers", "extras", "finish_reasons")


def select_rollout(rollout: Rollout, rows: list[int]) -> Rollout:
    """Rows ``rows`` of a rollout (batch, texts, group ids, scores); no metrics."""
    index = torch.as_tensor(rows, dtype=torch.long, device=rollout.group_ids.device)
    texts = {k: [getattr(rollout, k)[i] for i in rows] for k in _TEXTS}
    scores = None if rollout.scores is None else rollout.scores[index]
    return Rollout(batch=rollout.batch.select(index), group_ids=rollout.group_ids[index], scores=scores, **texts)


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """The rows of ``parts`` one after the other (token fields right-padded to the widest); no metrics.

    Every part holds the same fields (all with scores or none, the same per-token fields set)."""
    batches = [p.batch for p in parts]
    width = max(b.width for b in batches)
    fields = {"input_ids": cat_rows([b.input_ids for b in batches], width),
              "response_mask": cat_rows([b.response_mask for b in batches], width),
              "lengths": torch.cat([b.lengths for b in batches])}
    for name in PER_TOKEN + PER_SEQUENCE:
        if getattr(batches[0], name) is not None:
            values = [getattr(b, name) for b in batches]
            fields[name] = cat_rows(values, width) if name in PER_TOKEN else torch.cat(values)
    if batches[0].expert_ids is not None:
        fields["expert_ids"] = torch.cat([pad_positions(b.expert_ids, width) for b in batches])
    batch = SampleBatch(**fields, policy_version=batches[0].policy_version)
    scores = None if parts[0].scores is None else torch.cat([p.scores for p in parts])
    texts = {k: [x for p in parts for x in getattr(p, k)] for k in _TEXTS}
    return Rollout(batch=batch, group_ids=torch.cat([p.group_ids for p in parts]), scores=scores, **texts)


def response_metrics(rollout: Rollout) -> dict[str, float]:
    """Sums (and maxima) over this rank; the trainer reduces them over DP."""
    lengths = rollout.batch.response_mask.sum(-1)
    return {
        "response/length_sum": float(lengths.sum()),
        "response/clipped": float(sum(f == "length" for f in rollout.finish_reasons)),
        "response/count": float(len(lengths)),
        "prompt/length_sum": float((rollout.batch.lengths - lengths).sum()),
    }

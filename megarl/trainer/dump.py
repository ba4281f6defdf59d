"""Rollouts to disk and back: run generation alone, or train on generations made earlier.

One file per step and data-parallel rank, ``step_000001_dp0.pt``, holding the
token batch (with a mixture of experts' recorded expert ids, when recorded), the texts,
the scores and the group ids. Every rank of a TP x PP
replica holds the same rollout; the first one writes it.
"""
from __future__ import annotations

import os

import torch

from megarl.errors import DataError
from megarl.roles.batch import SampleBatch
from megarl.trainer.rollout import Rollout

_TEXT_FIELDS = ("prompts", "responses", "answers", "extras", "finish_reasons")


def dump_path(root: str, step: int, dp_rank: int) -> str:
    return os.path.join(root, f"step_{step:06d}_dp{dp_rank}.pt")


def save_rollout(rollout: Rollout, root: str, step: int, groups) -> None:
    if groups.tp_rank != 0 or groups.pp_rank != 0:
        return
    os.makedirs(root, exist_ok=True)
    b = rollout.batch
    payload = {
        "input_ids": b.input_ids.cpu(), "response_mask": b.response_mask.cpu(), "lengths": b.lengths.cpu(),
        "rollout_logprobs": b.rollout_logprobs.cpu(), "group_ids": rollout.group_ids.cpu(),
        "scores": None if rollout.scores is None else rollout.scores.cpu(), "policy_version": b.policy_version,
        "expert_ids": None if b.expert_ids is None else b.expert_ids.cpu(),  # MoE, recorded (uint8 | int16)
        "token_versions": None if b.token_versions is None else b.token_versions.cpu(),  # partial rollouts
        **{k: getattr(rollout, k) for k in _TEXT_FIELDS},
    }
    torch.save(payload, dump_path(root, step, groups.dp_rank))


def load_rollout(root: str, step: int, dp_rank: int, device) -> Rollout:
    path = dump_path(root, step, dp_rank)
    if not os.path.isfile(path):
        raise DataError(
            f"trainer.replay_rollouts: {path} not found; dump it first with trainer.dump_rollouts={root} "
            "using the same data-parallel size (or lower trainer.steps to the steps dumped)"
        )
    d = torch.load(path, weights_only=False)
    experts = d.get("expert_ids")
    batch = SampleBatch(d["input_ids"].to(device), d["response_mask"].to(device), d["lengths"].to(device),
                        rollout_logprobs=d["rollout_logprobs"].to(device), policy_version=d.get("policy_version", 0),
                        expert_ids=None if experts is None else experts.to(device))
    scores = None if d["scores"] is None else d["scores"].to(device)
    return Rollout(batch=batch, group_ids=d["group_ids"].to(device), scores=scores,
                   **{k: d[k] for k in _TEXT_FIELDS})

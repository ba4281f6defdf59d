"""What every role shares: a Megatron model stage driven through the pipeline schedule.

A role runs a function over micro-batches of a :class:`SampleBatch`. On the
last pipeline stage ``head(micro_batch, output)`` turns the model output into
``(loss_sum, count, metrics)``; the schedule sums ``loss_sum`` and ``count``
and the gradient is that of ``sum(loss_sum) / sum(count)`` over every
micro-batch and DP rank (see :mod:`megarl.roles.optim`). Forward-only runs
return the metrics (tensors) of every micro-batch on every stage.

:class:`RunOptions` say how: padded rows or one packed THD row per
micro-batch (the head reads ``mb.model_inputs`` either way, see
:mod:`megarl.roles.inputs`), and whether rows are first re-dealt over the DP
axis by token count (:mod:`megarl.roles.dp_balance`; then with token-budget
micro-batches every DP rank also runs the same number of them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config

from megarl.distributed import ParallelGroups, device
from megarl.models.moe import ExpertLoad
from megarl.models.pipeline import run_pipeline
from megarl.models.moe_padding import stage_padding
from megarl.models.router_replay import ReplayRouters
from megarl.roles.batch import SampleBatch, cat_rows
from megarl.roles.dp_balance import Dealt, deal_rows
from megarl.roles.inputs import ModelInputs, cp_packed_inputs, packed_inputs, padded_inputs
from megarl.roles.memory import MemoryBackoff, OutOfMemoryAgreed, any_rank, caught_oom, deferred_finalize
from megarl.roles.optim import Trainable

Head = Callable[[SampleBatch, torch.Tensor], tuple]
LOSS_KEY = "_loss_sum"  # the head's loss, carried beside its metrics to the optimizer step's guard


def imbalance(dealt: Dealt) -> dict[str, float]:
    """A training step's DP token balance: max over mean of the ranks' tokens, after and before."""
    return {"dp_token_imbalance": dealt.imbalance, "dp_token_imbalance_before": dealt.imbalance_before}


@dataclass(frozen=True)
class RunOptions:
    """How a role lays out its micro-batches."""

    packing: bool = False  # one packed THD row per micro-batch instead of padded rows
    pad_multiple: int = 1  # packed length / padded width a multiple of this (the TP size under sequence parallelism)
    dp_balance: bool = False  # re-deal rows over DP ranks by tokens (collective: every DP rank must call)


class ModelRole:
    """A model stage on this rank, trainable or frozen."""

    oom_group = None  # the ranks that agree on a forward's out-of-memory retry (None: every rank)

    def __init__(self, name: str, module, groups: ParallelGroups, info,
                 trainable: Optional[Trainable] = None, options: RunOptions = RunOptions(),
                 replay: Optional[ReplayRouters] = None):
        self.name = name
        self.module = module  # unwrapped GPTModel stage
        self.groups = groups
        self.info = info  # megarl.models.hf_config.ModelInfo
        self.trainable = trainable
        self.options = options
        self.backoff = MemoryBackoff(name)  # CUDA OOM: smaller micro-batches, retried (roles/memory.py)
        # mixture of experts, trained: tokens per expert of the update's forwards (moe/load_* metrics)
        self.expert_load = ExpertLoad(module, groups) if trainable and getattr(info, "moe", None) else None
        self.replay = replay  # actor.router_replay=r3: micro-batches' recorded expert ids replayed in every forward
        self.is_moe = bool(getattr(info, "moe", None))  # its routers read padding_mask (tokens of no sequence)

    @property
    def chunks(self) -> list:
        return self.trainable.chunks if self.trainable else [self.module]

    def run(self, micro_batches: list[SampleBatch], head: Head, forward_only: bool) -> list[dict]:
        """Runs ``head`` on every micro-batch's output; the metrics dicts, on every stage."""

        def loss_fn(mb: SampleBatch, output):
            loss, count, metrics = head(mb, output)
            if self.groups.cp_rank > 0:  # every CP rank has the whole loss; counts add over dp x cp
                count = torch.zeros_like(count)
            return loss, count, metrics if forward_only else {**metrics, LOSS_KEY: loss.detach()}

        def forward_step(mb: SampleBatch, model):
            x = mb.model_inputs
            if self.replay is not None:
                self.replay.load(mb.expert_ids, mb.lengths, x)
            moe = {"padding_mask": stage_padding(x.padding, self.module, self.groups)} if self.is_moe else {}
            out = model(x.input_ids, x.position_ids, None, packed_seq_params=x.packed_seq_params, **moe)
            return out, lambda output: loss_fn(mb, output)  # out: (b|1, l|T, V/tp) | (.., 1) | hidden

        micro_batches = [replace(mb, model_inputs=self.model_inputs(mb)) for mb in micro_batches]
        if self.replay is not None:
            self.replay.start()
        shapes = [mb.model_inputs.input_ids.shape for mb in micro_batches]  # (b, l) | (1, T)
        return run_pipeline(
            self.chunks, self.groups, micro_batches, forward_step, forward_only=forward_only,
            seq_length=max(s[1] for s in shapes), micro_batch_size=shapes[0][0], broadcast=True,
        )

    def model_inputs(self, mb: SampleBatch) -> ModelInputs:
        """What the model reads for micro-batch ``mb`` under this role's options."""
        g = self.groups
        if g.cp_size > 1:  # Ulysses: each CP rank runs its slice of every sequence
            return cp_packed_inputs(mb.input_ids, mb.lengths, g.cp, g.cp_size, g.cp_rank)
        if self.options.packing:
            return packed_inputs(mb.input_ids, mb.lengths, self.options.pad_multiple)
        return padded_inputs(mb.input_ids, mb.lengths, self.options.pad_multiple)

    def deal(self, batch: SampleBatch, keep_counts: bool) -> Dealt:
        """``batch``'s rows re-dealt over DP by tokens (when ``options.dp_balance``)."""
        dp = self.groups.dp_size if self.options.dp_balance else 1
        return deal_rows(batch, self.groups.dp if dp > 1 else None, dp, keep_counts)

    def micro_batch_index(self, batch: SampleBatch, micro_batch_size: int, max_tokens: int) -> list[list[int]]:
        """Micro-batch rows; token-budget bins are as many on every DP rank when balancing."""
        micro_batch_size, max_tokens = self.backoff.budget(micro_batch_size, max_tokens)
        index = batch.micro_batch_index(micro_batch_size, max_tokens)
        if max_tokens <= 0 or not self.options.dp_balance or self.groups.dp_size == 1:
            return index
        most = torch.tensor([len(index)], device=device())
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.groups.dp)
        return batch.micro_batch_index(micro_batch_size, max_tokens, int(most)) if int(most) > len(index) else index

    def forward_collect(self, batch: SampleBatch, micro_batch_size: int, head: Head,
                        max_tokens: int = 0) -> dict[str, torch.Tensor]:
        """Forward only; per-token outputs of ``head`` reassembled in batch order (B, L) | (B,)."""
        dealt = self.deal(batch, keep_counts=max_tokens <= 0)
        mine = dealt.batch
        index, results = self.backoff.retrying("forward", lambda: self._forward_all(mine, micro_batch_size, head,
                                                                                    max_tokens))
        order = torch.tensor([i for idx in index for i in idx])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        out = {}
        for key in results[0]:
            parts = [r[key] for r in results]
            merged = cat_rows(parts, mine.width) if parts[0].dim() == 2 else torch.cat(parts)
            out[key] = dealt.back(merged[inverse.to(merged.device)])
        return out

    def _forward_all(self, mine: SampleBatch, micro_batch_size: int, head: Head, max_tokens: int):
        """(index, results) of one forward-only pass; OutOfMemoryAgreed if any rank ran out."""
        index = self.micro_batch_index(mine, micro_batch_size, max_tokens)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                results, oom = caught_oom(lambda: self.run([mine.select(i) for i in index], head, forward_only=True))
        finally:
            self.module.train(was_training)
        if any_rank(oom, self.oom_group):
            raise OutOfMemoryAgreed()
        return index, results

    def train_step(self, micro_batches: list[SampleBatch] | Callable[[], list[SampleBatch]],
                   head: Head) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; summed metrics plus grad norm and LR.

        Skipped, on every rank, when the loss or a gradient is not finite
        (``nonfinite`` = 1; see :meth:`Trainable.step`). ``micro_batches`` may be a
        function that splits them under ``self.backoff``'s budget: after a CUDA OOM
        the step is retried on smaller ones (a fixed list is retried as it is).
        """
        make = micro_batches if callable(micro_batches) else (lambda: micro_batches)
        return self.backoff.retrying("update", lambda: self.finish_step(self.train_run(make(), head)))

    def train_run(self, micro_batches: list[SampleBatch], head: Head) -> list[dict]:
        """Forward and backward of every micro-batch (gradients reduced, no optimizer step);
        OutOfMemoryAgreed, gradients zeroed, if any rank ran out of memory."""
        self.trainable.zero_grad()
        with deferred_finalize(get_model_config(self.chunks[0])) as (finalize, calls):
            results, oom = caught_oom(lambda: self.run(micro_batches, head, forward_only=False))
        if any_rank(oom):
            self.trainable.zero_grad()
            raise OutOfMemoryAgreed()
        for args, kwargs in calls:  # the DP reduction, once every rank is known to have finished
            finalize(*args, **kwargs)
        return results

    def finish_step(self, results: list[dict]) -> dict[str, float]:
        """Sums the micro-batches' metrics and steps the optimizer unless the loss is not finite."""
        metrics = {}
        for r in results:
            for k, v in r.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
        loss = metrics.pop(LOSS_KEY)  # on every stage: run() broadcasts the last stage's results
        metrics.update(self.trainable.step(loss_finite=math.isfinite(loss)))
        if self.expert_load:
            metrics.update(self.expert_load.read())
        return {**metrics, **self.backoff.metrics()}

"""What every role shares: a Megatron model stage driven through the pipeline schedule.

A role runs a function over micro-batches of a :class:`SampleBatch`. On the
last pipeline stage ``head(micro_batch, output)`` turns the model output into
``(loss_sum, count, metrics)``; the schedule sums ``loss_sum`` and ``count``
and the gradient is that of ``sum(loss_sum) / sum(count)`` over every
micro-batch and DP rank (see :mod:`megarl.roles.optim`). Forward-only runs
return the metrics (tensors) of every micro-batch on every stage.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from megarl.distributed import ParallelGroups
from megarl.models.pipeline import run_pipeline
from megarl.roles.batch import SampleBatch, cat_rows
from megarl.roles.optim import Trainable

Head = Callable[[SampleBatch, torch.Tensor], tuple]
LOSS_KEY = "_loss_sum"  # the head's loss, carried beside its metrics to the optimizer step's guard


class ModelRole:
    """A model stage on this rank, trainable or frozen."""

    def __init__(self, name: str, module, groups: ParallelGroups, info,
                 trainable: Optional[Trainable] = None):
        self.name = name
        self.module = module  # unwrapped GPTModel stage
        self.groups = groups
        self.info = info  # megarl.models.hf_config.ModelInfo
        self.trainable = trainable

    @property
    def chunks(self) -> list:
        return self.trainable.chunks if self.trainable else [self.module]

    def run(self, micro_batches: list[SampleBatch], head: Head, forward_only: bool) -> list[dict]:
        """Runs ``head`` on every micro-batch's output; the metrics dicts, on every stage."""

        def loss_fn(mb: SampleBatch, output):
            loss, count, metrics = head(mb, output)
            return loss, count, metrics if forward_only else {**metrics, LOSS_KEY: loss.detach()}

        def forward_step(mb: SampleBatch, model):
            out = model(mb.input_ids, mb.position_ids(), None)  # (b, l, V/tp) | (b, l, 1) | hidden
            return out, lambda output: loss_fn(mb, output)

        width = max(mb.width for mb in micro_batches)
        return run_pipeline(
            self.chunks, self.groups, micro_batches, forward_step, forward_only=forward_only,
            seq_length=width, micro_batch_size=len(micro_batches[0]), broadcast=True,
        )

    def forward_collect(self, batch: SampleBatch, micro_batch_size: int, head: Head,
                        max_tokens: int = 0) -> dict[str, torch.Tensor]:
        """Forward only; per-token outputs of ``head`` reassembled in batch order (B, L)."""
        index = batch.micro_batch_index(micro_batch_size, max_tokens)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                results = self.run([batch.select(i) for i in index], head, forward_only=True)
        finally:
            self.module.train(was_training)
        order = torch.tensor([i for idx in index for i in idx])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        out = {}
        for key in results[0]:
            parts = [r[key] for r in results]
            merged = cat_rows(parts, batch.width) if parts[0].dim() == 2 else torch.cat(parts)
            out[key] = merged[inverse.to(merged.device)]
        return out

    def train_step(self, micro_batches: list[SampleBatch], head: Head) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; summed metrics plus grad norm and LR.

        Skipped, on every rank, when the loss or a gradient is not finite
        (``nonfinite`` = 1; see :meth:`Trainable.step`).
        """
        self.trainable.zero_grad()
        return self.finish_step(self.run(micro_batches, head, forward_only=False))

    def finish_step(self, results: list[dict]) -> dict[str, float]:
        """Sums the micro-batches' metrics and steps the optimizer unless the loss is not finite."""
        metrics = {}
        for r in results:
            for k, v in r.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
        loss = metrics.pop(LOSS_KEY)  # on every stage: run() broadcasts the last stage's results
        metrics.update(self.trainable.step(loss_finite=math.isfinite(loss)))
        return metrics

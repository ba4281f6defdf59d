"""The training ranks' end of the asynchronous pipeline (``trainer.mode=async``).

:class:`TrainingEnd` takes each step's batch from the queue (sent by the rollout replica of the
same data-parallel rank), checks its policy version against the bound, and pushes the weights
after every update (:class:`~megarl.trainer.weight_push.WeightPusher`). At the start it tells its
rollout replica where to begin: the step and the prompt sampler's position (after a resume: the
checkpoint's, so batches in flight when the run was killed are generated again from the
checkpoint's weights, and no batch older than the bound is ever trained on).
"""
from __future__ import annotations

from megarl.config import Config
from megarl.distributed.placement import Placement
from megarl.trainer.async_channel import BATCH_TAG, START_TAG, Outbox, QueuedBatch, recv_object, send_object
from megarl.trainer.async_rollout import lag_bound
from megarl.trainer.weight_push import WeightPusher


class TrainingEnd:
    """Queue receiver and weight pusher of one training rank."""

    def __init__(self, cfg: Config, placement: Placement, actor, groups):
        self.cfg, self.placement, self.groups = cfg, placement, groups
        ranks = placement.directory({"dp_rank": groups.dp_rank, "tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank,
                                     "cp_rank": groups.cp_rank})
        replica = [r for r in ranks if r["role"] == "rollout" and r["dp_rank"] == groups.dp_rank]
        self.replica = [r["rank"] for r in replica]  # the rollout ranks that generate this rank's prompts
        self.source = next(r["rank"] for r in replica if r["tp_rank"] == 0)  # the one that sends batches
        self.pusher = WeightPusher(actor.module, actor.info, groups, placement, placement.rollout_ranks,
                                   int(cfg.async_.bucket_mb * 2**20))
        self.outbox = Outbox()

    def start(self, step: int, sampler_state: dict, partial=None) -> None:
        """Where the rollout replica begins (rollout.partial: with ``partial``'s groups in flight, the
        checkpoint's), then the weights of version ``step``."""
        message = {"step": step, "sampler": sampler_state,
                   "partial": None if partial is None else partial.state_dict(),
                   "partial_dropped": 0 if partial is None else partial.dropped}
        if self.groups.tp_rank == self.groups.pp_rank == self.groups.cp_rank == 0:  # one rank per replica
            for dst in self.replica:
                send_object(self.placement.objects, message, dst, START_TAG, self.outbox)
        self.pusher.push(step)
        self.outbox.wait()

    def next_batch(self, step: int) -> QueuedBatch:
        """The batch of training step ``step`` (0-based); an error if its version breaks the bound."""
        batch = recv_object(self.placement.objects, self.source, BATCH_TAG)
        lag, oldest = step - batch.version, step - batch.rollout.batch.policy_version  # partial: oldest token
        bound = lag_bound(self.cfg)
        if batch.step != step or not 0 <= lag <= bound or not lag <= oldest <= self.cfg.async_.max_staleness:
            raise RuntimeError(f"the rollout queue gave the batch of step {batch.step} sampled by version "
                               f"{batch.version} (oldest token: {batch.rollout.batch.policy_version}) to step "
                               f"{step} (bound {bound}; tokens: async.max_staleness={self.cfg.async_.max_staleness})")
        batch.engine_stats.update({"async/staleness": float(lag), "async/policy_version": float(batch.version)})
        return batch

    def push(self, version: int) -> dict[str, float]:
        """The weights after ``version`` updates to every rollout rank."""
        return self.pusher.push(version)

    def stop(self) -> None:
        """Ends the rollout ranks (after the last step, or a stop signal)."""
        self.pusher.stop()

"""Process groups: built once by megatron-core, checked, passed down.

``ParallelGroups`` is the one object the rest of megarl receives; nothing
below the launch scripts calls ``parallel_state.get_*`` to find its groups.
Axes: tp (tensor), pp (pipeline), cp (context; Ulysses sequence parallel
uses it), dp (data). world = tp * cp * dp * pp. The expert layers of a
mixture of experts fold the same ranks of a pipeline stage differently:
tp * cp * dp = etp (expert tensor) * ep (expert) * edp (expert data), so
each of the ep ranks holds num_experts / ep whole experts, split etp ways.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.process_groups_config import ProcessGroupCollection

from megarl.distributed.init import collective_timeout_s


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's parallel groups and its coordinates on each axis."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup  # gradients are reduced over dp x cp
    ep: dist.ProcessGroup  # expert parallel: tokens are exchanged (alltoall) over it
    etp: dist.ProcessGroup  # expert tensor parallel: each expert's FFN is split over it
    edp: dist.ProcessGroup  # expert data parallel: expert gradients are reduced over it
    tp_size: int
    pp_size: int
    dp_size: int
    cp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_size: int
    etp_size: int
    ep_rank: int
    etp_rank: int
    collection: ProcessGroupCollection  # handed to megatron-core modules

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group."""
        return dist.get_global_rank(self.tp, 0)

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's PP group."""
        return dist.get_global_rank(self.pp, self.pp_size - 1)


def _check(name: str, group: dist.ProcessGroup, want: int) -> int:
    got = dist.get_world_size(group)
    if got != want:
        raise RuntimeError(f"{name} group has {got} ranks, expected {want}")
    return dist.get_rank(group)


def check_expert_layout(world: int, tp: int, pp: int, cp: int, ep: int, etp: int | None) -> int:
    """The expert tensor-parallel size (``etp`` None: tp); raises unless ep * etp divides a stage's ranks."""
    etp = tp if etp is None else etp
    stage = world // (tp * pp * cp) * tp * cp  # ranks of one pipeline stage
    if ep < 1 or etp < 1 or stage % (ep * etp):
        raise ValueError(
            f"parallel.ep={ep} x parallel.etp={etp} must divide the {stage} ranks of a pipeline stage "
            f"(world {world} / pp {pp}); change parallel.ep / parallel.etp or the number of processes")
    return etp


def build_parallel_groups(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
                          timeout_s: float | None = None) -> ParallelGroups:
    """Builds (or rebuilds) megatron-core's groups and wraps them.

    ``ep`` / ``etp``: expert-parallel and expert tensor-parallel sizes (``etp`` None: tp).
    ``timeout_s`` bounds each collective on these groups; default: the world
    group's (``trainer.collective_timeout_s``, see :mod:`megarl.distributed.init`).
    """
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
            "change parallel.tp / parallel.pp / parallel.cp or the number of processes"
        )
    etp = check_expert_layout(world, tp, pp, cp, ep, etp)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=(timeout_s or collective_timeout_s()) / 60,  # timedelta takes fractions
    )
    dp = world // (tp * pp * cp)
    groups = dict(
        tp=mpu.get_tensor_model_parallel_group(),
        pp=mpu.get_pipeline_model_parallel_group(),
        dp=mpu.get_data_parallel_group(),
        cp=mpu.get_context_parallel_group(),
        dp_cp=mpu.get_data_parallel_group(with_context_parallel=True),
        ep=mpu.get_expert_model_parallel_group(),
        etp=mpu.get_expert_tensor_parallel_group(),
        edp=mpu.get_expert_data_parallel_group(),
    )
    ranks = dict(
        tp_rank=_check("tp", groups["tp"], tp),
        pp_rank=_check("pp", groups["pp"], pp),
        dp_rank=_check("dp", groups["dp"], dp),
        cp_rank=_check("cp", groups["cp"], cp),
        ep_rank=_check("ep", groups["ep"], ep),
        etp_rank=_check("etp", groups["etp"], etp),
    )
    _check("dp_cp", groups["dp_cp"], dp * cp)
    _check("edp", groups["edp"], dp * cp * tp // (ep * etp))
    return ParallelGroups(
        **groups, **ranks, tp_size=tp, pp_size=pp, dp_size=dp, cp_size=cp, ep_size=ep, etp_size=etp,
        collection=ProcessGroupCollection.use_mpu_process_groups(),
    )

"""megatron-core distributed checkpoints of a model, with megarl's metadata beside them.

``save_mcore`` writes ``model.sharded_state_dict()`` with
``dist_checkpointing.save`` (any TP / PP; loadable at any other) and
``megarl_model.json`` (architecture, HF config, source directory, dtype), so
that ``load_mcore_meta`` + ``build_gpt_model`` + ``load_mcore`` rebuild the
model without extra flags.

``dist_checkpointing.save`` starts a multiprocessing manager that re-imports
``__main__``: scripts calling it need an ``if __name__ == "__main__":`` guard.
megatron-core is imported inside the functions, so reading the metadata
(input checks) stays light.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from typing import TYPE_CHECKING

from megarl.models.hf_config import ModelConfigError, ModelInfo

if TYPE_CHECKING:
    from torch import nn

    from megarl.distributed.groups import ParallelGroups

META = "megarl_model.json"


def save_mcore(model: "nn.Module", info: ModelInfo, groups: "ParallelGroups", out_dir: str,
               *, source: Optional[str] = None, params_dtype: str = "fp32") -> None:
    """Collective: writes this rank's shards and (rank 0) the metadata file."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    state = model.sharded_state_dict(metadata={"dp_cp_group": groups.dp_cp})
    dist_checkpointing.save(state, out_dir)
    if dist.get_rank() == 0:
        meta = dict(info.to_json(), source=source, params_dtype=params_dtype,
                    saved_tp=groups.tp_size, saved_pp=groups.pp_size, saved_ep=groups.ep_size)
        with open(os.path.join(out_dir, META), "w") as f:
            json.dump(meta, f, indent=2)
    dist.barrier()


def load_mcore_meta(ckpt_dir: str) -> dict:
    """The metadata ``save_mcore`` wrote; ``ModelInfo.from_json(meta)`` rebuilds the info."""
    path = os.path.join(ckpt_dir, META)
    if not os.path.isdir(ckpt_dir):
        raise ModelConfigError(f"checkpoint directory {ckpt_dir!r} does not exist")
    if not os.path.isfile(path):
        raise ModelConfigError(f"{ckpt_dir!r} has no {META}; was it written by megarl (launch/convert.py)?")
    with open(path) as f:
        return json.load(f)


def check_same_experts(saved: ModelInfo, info: ModelInfo, ckpt_dir: str) -> None:
    """Raises unless ``info`` (the config a run builds) has the experts and top-k the checkpoint was saved with."""
    def shape(i: ModelInfo):
        return (i.moe.num_experts, i.moe.topk) if i.moe else (None, None)

    (saved_e, saved_k), (e, k) = shape(saved), shape(info)
    if (saved_e, saved_k) != (e, k):
        raise ModelConfigError(
            f"{ckpt_dir!r} was saved with num_experts={saved_e} top-k={saved_k} but the config asks for "
            f"num_experts={e} top-k={k}; use the config.json the checkpoint was converted from")


def load_mcore(model: "nn.Module", groups: "ParallelGroups", ckpt_dir: str) -> None:
    """Collective: fills ``model`` (built at any TP / PP) from the distributed checkpoint."""
    from megatron.core import dist_checkpointing

    state = model.sharded_state_dict(metadata={"dp_cp_group": groups.dp_cp})
    loaded = dist_checkpointing.load(state, ckpt_dir)
    model.load_state_dict(loaded, strict=True)

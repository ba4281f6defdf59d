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


# -- training checkpoints (megarl/trainer/checkpoint.py: step_N/<role>/) ----------------------------

def lora_of(module: "nn.Module") -> Optional[dict]:
    """The LoRA adapters of ``module`` as {rank, alpha, targets, experts}, or None without adapters
    (experts: the routed experts are adapted too)."""
    linears = [(name, m) for name, m in module.named_modules() if hasattr(m, "lora_enabled")]
    if not linears:
        return None
    first = linears[0][1]
    rank = int(first.lora_a.shape[-2])  # A: (r, in), or (experts, r, in) stacked on GroupedMLP
    return {"rank": rank, "alpha": float(first.lora_scale * rank),
            "targets": sorted({getattr(m, "lora_target", name.rsplit(".", 1)[-1]) for name, m in linears}),
            "experts": any(".mlp.experts." in name for name, _ in linears)}


def write_role_meta(role_dir: str, module: "nn.Module", info: ModelInfo, build: dict) -> None:
    """``role_dir``/megarl_model.json of a training checkpoint's role: the model (architecture, HF
    config, value head), ``build`` (source directory, params_dtype, layer_spec, vocab_divisible_by)
    and its LoRA adapters, so launch/convert.py rebuilds it from the checkpoint alone."""
    meta = dict(info.to_json(), **build, lora=lora_of(module))
    with open(os.path.join(role_dir, META), "w") as f:
        json.dump(meta, f, indent=2)


def training_role_dir(ckpt: str, role: str = "actor") -> Optional[str]:
    """The ``role`` directory of a training checkpoint named by ``ckpt`` (a run directory, its
    ``checkpoints/``, a ``step_N`` or ``step_N/<role>``); None for a plain converted checkpoint."""
    if os.path.isfile(os.path.join(ckpt, META)) and not os.path.isfile(os.path.join(ckpt, "..", "state.json")):
        return None
    root = os.path.join(ckpt, "checkpoints") if os.path.isdir(os.path.join(ckpt, "checkpoints")) else ckpt
    latest = os.path.join(root, "latest")
    if os.path.isfile(latest):
        step = open(latest).read().strip()
        ckpt = os.path.join(root, f"step_{int(step):06d}") if step.isdigit() else ckpt
    if os.path.isdir(os.path.join(ckpt, role)) and os.path.isfile(os.path.join(ckpt, "state.json")):
        return os.path.join(ckpt, role)
    if os.path.isfile(os.path.join(ckpt, "..", "state.json")) and os.path.basename(os.path.normpath(ckpt)) == role:
        return ckpt
    return None


def load_training_meta(role_dir: str, hf_config_from: Optional[str] = None) -> dict:
    """megarl_model.json of a training checkpoint's role; a checkpoint saved before megarl wrote it
    is described by ``hf_config_from`` (the run's model.path; no LoRA)."""
    if os.path.isfile(os.path.join(role_dir, META)):
        with open(os.path.join(role_dir, META)) as f:
            return json.load(f)
    if not hf_config_from:
        raise ModelConfigError(f"{role_dir!r} has no {META} (saved by an older megarl); pass --hf-config-from "
                               "with the run's model.path to describe the model")
    from megarl.models.hf_config import load_config_json

    if _has_lora(role_dir):
        raise ModelConfigError(f"{role_dir!r} holds LoRA adapters but no {META} (saved by an older megarl), so "
                               "their rank and scale are unknown; evaluate or export it with the megarl that saved it")
    return {"arch": None, "value_head": False, "hf_config": load_config_json(hf_config_from),
            "source": hf_config_from, "params_dtype": "fp32", "lora": None}


def load_training_model(model: "nn.Module", role_dir: str) -> None:
    """Collective: fills ``model`` (built at any TP / PP, with the checkpoint's LoRA adapters) from
    a training checkpoint's role directory; the optimizer and scheduler there are not read."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, role_dir)
    model.load_state_dict(loaded["model"], strict=True)


def _has_lora(role_dir: str) -> bool:
    """Whether the distributed checkpoint in ``role_dir`` holds LoRA adapter tensors."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(role_dir).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata: the load that follows says why
        return False
    return any(".lora_a" in k or ".lora_b" in k for k in keys)

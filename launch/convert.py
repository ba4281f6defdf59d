"""Convert Hugging Face checkpoints to megatron-core distributed checkpoints and back.

    torchrun --nproc_per_node 2 launch/convert.py hf-to-mcore --hf DIR --out DIR --tp 2
    torchrun --nproc_per_node 2 launch/convert.py mcore-to-hf --ckpt DIR --out DIR --tp 2
    python launch/convert.py mcore-to-hf --ckpt runs/x/checkpoints/step_000030 --out DIR
    torchrun --nproc_per_node 2 launch/convert.py hf-to-mcore --hf DIR --out DIR --ep 2   (experts over 2 ranks)

The world size must be a multiple of tp * pp. mcore-to-hf reads the model's
metadata (megarl_model.json) from the checkpoint; tokenizer files are copied
from --hf-config-from, else from the directory the checkpoint was converted
from (when it still exists). --ckpt may also be a training checkpoint (a run
directory, its newest; or step_N): its actor is exported, LoRA merged, the
critic and value head left out. Bad input prints one line and exits with 2.
"""
from __future__ import annotations

import argparse
import os
import sys

_DTYPES = ("fp32", "bf16", "fp16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF directory -> megatron-core distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="Hugging Face model directory")
    to_mcore.add_argument("--dtype", choices=_DTYPES, default="fp32", help="parameter dtype")
    to_hf = sub.add_parser("mcore-to-hf", help="megatron-core distributed checkpoint -> HF directory")
    to_hf.add_argument("--ckpt", required=True, help="distributed checkpoint written by hf-to-mcore")
    to_hf.add_argument("--hf-config-from", default=None,
                       help="HF directory whose config.json and tokenizer files to use")
    for p in (to_mcore, to_hf):
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
        p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    return parser.parse_args(argv)


def check_layout(args, world_size: int) -> None:
    """The world must split into tp * pp groups: said before megatron-core is imported."""
    from megarl.models.hf_config import ModelConfigError

    if args.tp < 1 or args.pp < 1:
        raise ModelConfigError(f"--tp {args.tp} --pp {args.pp}: both must be >= 1")
    if world_size % (args.tp * args.pp):
        raise ModelConfigError(f"world size {world_size} is not a multiple of --tp {args.tp} x --pp {args.pp}; "
                               f"start {args.tp * args.pp} processes (torchrun --nproc_per_node {args.tp * args.pp})")
    etp = args.tp if args.etp is None else args.etp
    if args.ep < 1 or etp < 1 or (world_size // args.pp) % (args.ep * etp):
        raise ModelConfigError(f"--ep {args.ep} x --etp {etp} must divide the {world_size // args.pp} ranks of a "
                               f"pipeline stage (world size {world_size} / --pp {args.pp})")


def check_input(args) -> "ModelInfo":  # noqa: F821 - imported lazily below
    """The model to build; raises ModelConfigError on bad input (before any process group)."""
    from megarl.models.hf_config import ModelConfigError

    info = _model_info(args)
    if info.moe is None and (args.ep > 1 or args.etp not in (None, args.tp)):
        raise ModelConfigError(f"--ep {args.ep} / --etp {args.etp} need a mixture-of-experts model; {info.arch} is dense")
    if info.moe and info.moe.num_experts % args.ep:
        raise ModelConfigError(f"--ep {args.ep} must divide the model's {info.moe.num_experts} experts")
    return info


def _model_info(args) -> "ModelInfo":  # noqa: F821
    from megarl.models.hf_config import ModelInfo, read_hf_config
    from megarl.models.hub import resolve_model_path
    from megarl.models.mcore_ckpt import check_same_experts, load_mcore_meta, load_training_meta, training_role_dir

    if args.command == "hf-to-mcore":
        args.hf = resolve_model_path(args.hf, "--hf")
        info = read_hf_config(args.hf)
        from megarl.models.safetensors_io import CheckpointReader  # imports torch

        CheckpointReader(args.hf).close()  # safetensors present and readable
        return info
    role_dir = training_role_dir(args.ckpt)
    if role_dir is not None:
        meta = load_training_meta(role_dir, args.hf_config_from)
        return ModelInfo.from_json(meta)  # the actor: a causal LM (the critic is not exported)
    meta = load_mcore_meta(args.ckpt)
    if args.hf_config_from:
        info = read_hf_config(args.hf_config_from)
        check_same_experts(ModelInfo.from_json(meta), info, args.ckpt)
        return info.as_value_model() if meta["value_head"] and not info.value_head else info
    return ModelInfo.from_json(meta)


def build_training_model(info, groups, meta: dict):
    """The actor as the run built it (dtype, layer spec, vocab padding), its LoRA adapters attached."""
    from megarl.models import ModelOptions, build_gpt_model
    from megarl.models.lora import LoraOptions, apply_lora

    lora = meta.get("lora") or {}
    opts = ModelOptions(params_dtype=meta.get("params_dtype", "fp32"), layer_spec=meta.get("layer_spec", "auto"),
                        make_vocab_size_divisible_by=meta.get("vocab_divisible_by", 128))
    model = build_gpt_model(info, groups, opts)
    if lora:
        apply_lora(model, LoraOptions(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]),
                                      experts=lora.get("experts", False)))
    return model


def main(args) -> str:
    """Converts; returns the success line (rank 0 prints it)."""
    import time

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import ModelOptions, build_gpt_model, export_hf, load_hf_checkpoint
    from megarl.models.lora import merged_lora
    from megarl.models.mcore_ckpt import (load_mcore, load_mcore_meta, load_training_meta, load_training_model,
                                          save_mcore, training_role_dir)

    start = time.perf_counter()
    info = check_input(args)
    init_distributed()
    groups = build_parallel_groups(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    model_parallel_cuda_manual_seed(0)
    if args.command == "hf-to-mcore":
        model = build_gpt_model(info, groups, ModelOptions(params_dtype=args.dtype))
        load_hf_checkpoint(model, args.hf, info, groups)
        save_mcore(model, info, groups, args.out, source=os.path.abspath(args.hf), params_dtype=args.dtype)
        experts = f", ep={args.ep}" if args.ep > 1 else ""
        what = f"megatron-core checkpoint (tp={args.tp}, pp={args.pp}{experts}, {args.dtype})"
    else:
        role_dir = training_role_dir(args.ckpt)
        if role_dir is not None:
            meta = load_training_meta(role_dir, args.hf_config_from)
            model = build_training_model(info, groups, meta)
            load_training_model(model, role_dir)
        else:
            meta = load_mcore_meta(args.ckpt)
            model = build_gpt_model(info, groups, ModelOptions(params_dtype=meta["params_dtype"]))
            load_mcore(model, groups, args.ckpt)
        source = args.hf_config_from or meta.get("source")
        copy_from = source if source and os.path.isdir(source) else None
        with merged_lora(model):  # plain weights W + s B A (no adapters: a no-op)
            summary = export_hf(model, info, groups, args.out, copy_from=copy_from)
        what = (f"Hugging Face checkpoint ({summary.tensors} tensors, {summary.bytes / 2**20:.1f} MiB)"
                if summary else "Hugging Face checkpoint")
    return f"convert.py: wrote {what} to {args.out} in {time.perf_counter() - start:.1f} s"


if __name__ == "__main__":  # guard: dist_checkpointing's manager re-imports __main__
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megarl.cli import first_on_host
    from megarl.distributed import discover
    from megarl.launch_common import quiet_libraries
    from megarl.models.hf_config import ModelConfigError

    quiet_libraries()  # megatron-core's CPU and deprecation warnings
    arguments = parse_args()
    rank_info = discover()
    try:
        check_layout(arguments, rank_info.world_size)
        check_input(arguments)
        done = main(arguments)
    except (ModelConfigError, ValueError) as e:
        if first_on_host():  # every process fails alike: one line per host
            print(f"convert.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if rank_info.rank == 0:
        print(done, flush=True)

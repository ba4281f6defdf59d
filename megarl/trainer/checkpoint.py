"""Checkpoints with megatron-core distributed checkpointing; resume is automatic.

Layout under ``<run_dir>/checkpoints/``::

    step_000004/actor/      model + distributed-optimizer shards, LR scheduler
    step_000004/critic/     the same for the critic
    step_000004/<role>/megarl_model.json  the model, how it was built, its LoRA (launch/convert.py reads it)
    step_000004/state.json  step, data position, KL controller, layout, model signatures (rank 0)
    step_000004/rng/rank_N.pt  this rank's RNG states (torch's and megatron's tracker's)
    step_000004/<name>/rank_N.pt  this rank's own trainer state, if any (partial rollouts in flight)
    latest                  the newest complete step (written last)

A save is atomic: everything goes to ``step_N.partial/``, which is renamed to
``step_N/`` once every rank has written its part, and ``latest`` is replaced
after that; a run killed mid-save leaves a ``.partial`` directory that resume
ignores and the next save removes, and ``latest`` still names a whole step.

Resuming on another layout: the data-parallel size may change (megatron
reshards the model and the dp_reshardable optimizer state); each rank's RNG
then restarts from ``trainer.seed`` and the step, since the saved streams
belonged to other ranks. A change megatron cannot reshard, and a damaged or
foreign checkpoint, is a one-line error (:mod:`megarl.trainer.resume`).

Frozen roles (reference, reward model) are reloaded from their HF directories.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

from megarl.errors import CheckpointError
from megarl.models.mcore_ckpt import write_role_meta
from megarl.roles.optim import inner_optimizers, resync_offloaded_masters
from megarl.trainer import resume
from megarl.trainer.resume import Layout

# Optimizer state: megatron's dp_reshardable format (fast; reshards over data-parallel ranks only); a
# mixture of experts' in fully_reshardable (per parameter, gathered at save), which also reshards over
# EP: an expert's Adam moments follow it to whichever EP rank holds it. state.json records the format.
DENSE_OPT_FORMAT, MOE_OPT_FORMAT = "dp_reshardable", "fully_reshardable"


def optimizer_format(role) -> str:
    return MOE_OPT_FORMAT if getattr(role.info, "moe", None) else DENSE_OPT_FORMAT


_set_param_states = DistributedOptimizer._set_main_param_and_optimizer_states


def _set_param_states_but_step(self, model_param, tensors):
    """megatron-core 0.16.1's fully_reshardable load leaves torch Adam's scalar ``step`` out of the saved
    tensors, then copies every key of the parameter's state, ``step`` included (KeyError without
    apex / TE). The step is left as it is here; ``set_adam_step`` sets the saved count after the load."""
    if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return _set_param_states(self, model_param, tensors)
    group, order = self.model_param_group_index_map[model_param]
    state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
    step = state.pop("step", None)
    try:
        _set_param_states(self, model_param, tensors)
    finally:
        if step is not None:
            state["step"] = step


DistributedOptimizer._set_main_param_and_optimizer_states = _set_param_states_but_step


def _stepped(optimizer) -> bool:
    """Whether Adam has state yet (a role may not have been updated, e.g. during critic warmup)."""
    return all(len(inner.state) > 0 for inner in inner_optimizers(optimizer))


def adam_step(optimizer) -> float:
    """torch Adam's step count (megatron-core's dp_reshardable format does not restore it)."""
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            return float(state["step"])
    return 0.0


def set_adam_step(optimizer, step: float) -> None:
    """Where the primed state keeps its counter: the host for torch's default Adam, the
    parameter's device for the fused one (its kernel reads the step there)."""
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32, device=state["step"].device)


def _role_state(role, loading: bool, with_optimizer: bool, fmt: str) -> dict:
    model_sd = role.module.sharded_state_dict()
    state = {"model": model_sd, "scheduler": role.trainable.scheduler.state_dict()}
    if with_optimizer:
        state["optimizer"] = role.trainable.optimizer.sharded_state_dict(
            model_sd, is_loading=loading, metadata={"distrib_optim_sharding_type": fmt})
    return state


def _prime_optimizer(role) -> None:
    """torch Adam has no state before its first step; a zero-gradient step creates it."""
    role.trainable.zero_grad()
    role.trainable.optimizer.step()


def _save_rng(path: str) -> None:
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                "tracker": get_cuda_rng_tracker().get_states()}, path)


def _read_rng(path: str) -> tuple[dict | None, str | None]:
    """The RNG states saved in ``path``, or None and a one-line reason it cannot be read."""
    try:
        rng = torch.load(path, weights_only=False)
        if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
            raise TypeError("not a megarl RNG-state dict")
        return rng, None
    except Exception as e:  # noqa: BLE001 - truncated (OSError / EOFError), unpicklable, not ours
        why = " ".join(str(e).split())[:200]
        return None, (f"cannot read {path} (a truncated or damaged RNG-state file?): {type(e).__name__}"
                      f"{': ' + why if why else ''}; {resume.FIX_DAMAGED}")


def _agree_on(problem: str | None) -> None:
    """Raises on every rank the first rank's problem, so a bad file on any rank stops all of them
    with one line (rank 0's host prints it) instead of one rank dying while the others wait."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointError(first)


def _restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng.get("tracker"):
        get_cuda_rng_tracker().set_states(rng["tracker"])


def _reseed(seed: int, step: int) -> None:
    """Fresh RNG streams, a function of (seed, step) and this rank's TP / PP coordinates."""
    torch.manual_seed(seed + step)
    model_parallel_cuda_manual_seed(seed + step)


def checkpoint_build_meta(cfg) -> dict:
    """How the trained roles were built, for each role's megarl_model.json."""
    dtypes = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    return {"source": os.path.abspath(cfg.model.tokenizer or cfg.model.path), "params_dtype": dtypes[cfg.model.dtype],
            "layer_spec": cfg.model.layer_spec, "vocab_divisible_by": cfg.model.vocab_divisible_by}


class Checkpointer:
    """Saves and restores the trainable roles and the trainer's own state.

    ``layout`` (this run's) is recorded on save and checked on load; ``seed``
    reseeds the RNG when a resume changes the layout.
    """

    def __init__(self, run_dir: str, keep_last: int, layout: Layout | None = None, seed: int = 0,
                 build: dict | None = None):
        self.root = os.path.join(run_dir, "checkpoints")
        self.keep_last = max(keep_last, 1)
        self.rank = dist.get_rank()
        self.layout, self.seed = layout, seed
        self.build = build or {}  # how the roles were built (source, params_dtype, ...): megarl_model.json

    def _dir(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:06d}")

    def _steps(self) -> list[int]:
        """Complete step directories on disk, oldest first (``.partial`` ones are not)."""
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        return sorted(int(d[5:]) for d in names if d.startswith("step_") and d[5:].isdigit())

    def latest_step(self) -> int | None:
        path = os.path.join(self.root, "latest")
        if not os.path.isfile(path):
            return None
        text = open(path).read().strip()
        if not text.isdigit() or not os.path.isdir(self._dir(int(text))):
            raise CheckpointError(f"{path} names step {text!r}, which is not a saved step here; delete it to resume "
                              f"from step_* by hand, or set trainer.resume=false to start over")
        return int(text)

    def save(self, step: int, roles: dict, state: dict, rank_files: dict | None = None) -> str:
        """``rank_files``: name -> this rank's own state, written to ``<name>/rank_N.pt`` (read back with
        :meth:`read_rank_file`)."""
        final = self._dir(step)
        path = final + ".partial"
        if self.rank == 0:
            names = os.listdir(self.root) if os.path.isdir(self.root) else []
            for stale in (d for d in names if d.endswith(".partial")):  # an interrupted save
                shutil.rmtree(os.path.join(self.root, stale), ignore_errors=True)
            os.makedirs(os.path.join(path, "rng"), exist_ok=True)
        dist.barrier()
        stepped = {}
        for name, role in roles.items():
            os.makedirs(os.path.join(path, name), exist_ok=True)
            stepped[name] = _stepped(role.trainable.optimizer)
            dist_checkpointing.save(_role_state(role, False, stepped[name], optimizer_format(role)),
                                    os.path.join(path, name))
            if self.rank == 0:
                write_role_meta(os.path.join(path, name), role.module, role.info, self.build)
        steps = {name: adam_step(role.trainable.optimizer) for name, role in roles.items()}
        state = dict(state, optimizer_saved=stepped, adam_steps=steps,
                     optimizer_formats={name: optimizer_format(role) for name, role in roles.items()},
                     models={name: resume.model_signature(role.info) for name, role in roles.items()})
        if self.layout is not None:
            state["layout"] = asdict(self.layout)
        _save_rng(os.path.join(path, "rng", f"rank_{self.rank}.pt"))
        for name, obj in (rank_files or {}).items():
            os.makedirs(os.path.join(path, name), exist_ok=True)
            torch.save(obj, os.path.join(path, name, f"rank_{self.rank}.pt"))
        if self.rank == 0:
            with open(os.path.join(path, "state.json"), "w") as f:
                json.dump(state, f)
        dist.barrier()
        if self.rank == 0:
            if os.path.isdir(final):  # the same step saved again (a resumed run re-saving it)
                shutil.rmtree(final)
            os.replace(path, final)
            with open(os.path.join(self.root, "latest.tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(self.root, "latest.tmp"), os.path.join(self.root, "latest"))
            self._prune(step)
        dist.barrier()
        return final

    def _prune(self, newest: int) -> None:
        steps = self._steps()
        for old in steps[: -self.keep_last]:
            if old != newest:
                shutil.rmtree(self._dir(old), ignore_errors=True)

    def read_rank_file(self, step: int, name: str):
        """This rank's ``name`` state saved with ``step``; None when the step has none for it or was saved
        with another layout (the rank numbers then mean other ranks)."""
        path = os.path.join(self._dir(step), name, f"rank_{self.rank}.pt")
        state = json.load(open(os.path.join(self._dir(step), "state.json")))
        saved = state.get("layout")
        if not os.path.isfile(path) or self.layout is None or saved != asdict(self.layout):
            return None
        return torch.load(path, weights_only=False)

    def read_rank_files(self, step: int, name: str) -> list:
        """Every rank's ``name`` state saved with ``step``, whatever the layout."""
        folder = os.path.join(self._dir(step), name)
        files = sorted(f for f in os.listdir(folder) if f.endswith(".pt")) if os.path.isdir(folder) else []
        return [torch.load(os.path.join(folder, f), weights_only=False) for f in files]

    def load(self, step: int, roles: dict, expect: tuple[str, ...] = ()) -> dict:
        """Restores ``roles`` and RNG in place; returns the saved trainer state (holding ``expect``)."""
        path = self._dir(step)
        state = resume.read_state(path, roles, expect)
        resume.check_role_dirs(path, roles)
        resume.check_models(path, state, roles)
        same_layout = resume.check_layout(path, state, self.layout)
        rng_file = os.path.join(path, "rng", f"rank_{self.rank}.pt")
        rng, problem = _read_rng(rng_file) if same_layout and os.path.isfile(rng_file) else (None, None)
        _agree_on(problem)  # before the (slow) role loads
        for name, role in roles.items():
            self._load_role(role, os.path.join(path, name), state, name)
        if rng is not None:
            _restore_rng(rng)
        else:
            _reseed(self.seed, state["step"])
            if self.rank == 0:
                saved = Layout(**state["layout"]).describe() if "layout" in state else "another layout"
                mine = self.layout.describe() if self.layout else "this layout"
                print(f"resuming with {mine} a checkpoint saved with {saved}: "
                      f"RNG streams restart from trainer.seed and the step", flush=True)
        return state

    @staticmethod
    def _load_role(role, role_dir: str, state: dict, name: str) -> None:
        with_optimizer = state["optimizer_saved"][name]
        if with_optimizer:
            _prime_optimizer(role)
        try:
            fmt = state.get("optimizer_formats", {}).get(name, DENSE_OPT_FORMAT)  # as saved
            loaded = dist_checkpointing.load(_role_state(role, True, with_optimizer, fmt), role_dir)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - complete-looking, but does not read
            raise resume.load_failure(role_dir, e) from None
        role.module.load_state_dict(loaded["model"])
        if with_optimizer:
            with torch.no_grad():
                role.trainable.optimizer.load_state_dict(loaded["optimizer"])
            resync_offloaded_masters(role.trainable.optimizer)
            set_adam_step(role.trainable.optimizer, state["adam_steps"][name])
        role.trainable.scheduler.load_state_dict(loaded["scheduler"])

"""Checkpoints with megatron-core distributed checkpointing; resume is automatic.

Layout under ``<run_dir>/checkpoints/``::

    step_000004/actor/      model + distributed-optimizer shards, LR scheduler
    step_000004/critic/     the same for the critic
    step_000004/state.json  step, data position, KL controller (rank 0)
    step_000004/rng/rank_N.pt  this rank's RNG states
    latest                  the newest complete step (written last)

A save is atomic: everything goes to ``step_N.partial/``, which is renamed to
``step_N/`` once every rank has written its part, and ``latest`` is replaced
after that; a run killed mid-save leaves a ``.partial`` directory that resume
ignores and the next save removes, and ``latest`` still names a whole step.

Frozen roles (reference, reward model) are reloaded from their HF directories.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.cli import ConfigError

_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _stepped(optimizer) -> bool:
    """Whether Adam has state yet (a role may not have been updated, e.g. during critic warmup)."""
    return all(len(inner.state) > 0 for inner in _inner_optimizers(optimizer))


def _inner_optimizers(optimizer) -> list:
    return [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def adam_step(optimizer) -> float:
    """torch Adam's step count (megatron-core's dp_reshardable format does not restore it)."""
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            return float(state["step"])
    return 0.0


def set_adam_step(optimizer, step: float) -> None:
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32)


def _role_state(role, loading: bool, with_optimizer: bool) -> dict:
    model_sd = role.module.sharded_state_dict()
    state = {"model": model_sd, "scheduler": role.trainable.scheduler.state_dict()}
    if with_optimizer:
        state["optimizer"] = role.trainable.optimizer.sharded_state_dict(
            model_sd, is_loading=loading, metadata=_OPT_METADATA)
    return state


def _prime_optimizer(role) -> None:
    """torch Adam has no state before its first step; a zero-gradient step creates it."""
    role.trainable.zero_grad()
    role.trainable.optimizer.step()


class Checkpointer:
    """Saves and restores the trainable roles and the trainer's own state."""

    def __init__(self, run_dir: str, keep_last: int):
        self.root = os.path.join(run_dir, "checkpoints")
        self.keep_last = max(keep_last, 1)
        self.rank = dist.get_rank()

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
            raise ConfigError(f"{path} names step {text!r}, which is not a saved step here; delete it to resume "
                              f"from step_* by hand, or set trainer.resume=false to start over")
        return int(text)

    def save(self, step: int, roles: dict, state: dict) -> str:
        final = self._dir(step)
        path = final + ".partial"
        if self.rank == 0:
            for stale in (d for d in os.listdir(self.root) if d.endswith(".partial")) if os.path.isdir(self.root) else ():
                shutil.rmtree(os.path.join(self.root, stale), ignore_errors=True)  # an interrupted save
            os.makedirs(os.path.join(path, "rng"), exist_ok=True)
        dist.barrier()
        stepped = {}
        for name, role in roles.items():
            os.makedirs(os.path.join(path, name), exist_ok=True)
            stepped[name] = _stepped(role.trainable.optimizer)
            dist_checkpointing.save(_role_state(role, False, stepped[name]), os.path.join(path, name))
        steps = {name: adam_step(role.trainable.optimizer) for name, role in roles.items()}
        state = dict(state, optimizer_saved=stepped, adam_steps=steps)
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   os.path.join(path, "rng", f"rank_{self.rank}.pt"))
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

    def load(self, step: int, roles: dict) -> dict:
        """Restores ``roles`` and RNG in place; returns the saved trainer state."""
        path = self._dir(step)
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        for name, role in roles.items():
            with_optimizer = state["optimizer_saved"][name]
            if with_optimizer:
                _prime_optimizer(role)
            loaded = dist_checkpointing.load(_role_state(role, True, with_optimizer), os.path.join(path, name))
            role.module.load_state_dict(loaded["model"])
            if with_optimizer:
                with torch.no_grad():
                    role.trainable.optimizer.load_state_dict(loaded["optimizer"])
                set_adam_step(role.trainable.optimizer, state["adam_steps"][name])
            role.trainable.scheduler.load_state_dict(loaded["scheduler"])
        rng = torch.load(os.path.join(path, "rng", f"rank_{self.rank}.pt"), weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return state

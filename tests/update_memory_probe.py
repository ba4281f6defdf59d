"""launch/ppo.py (same argv) with a watch on what a PPO step leaves alive; one JSON row per optimizer step
of the actor at LIVE_MEMORY_OUT (rank 0; a single-process run).

At the entry of every actor optimizer step (the backward passes done): ``saved`` / ``saved_bytes``,
tensors that autograd graphs of the run still hold for backward (tests/saved_tensor_watch.py: the
update's activations kept alive, what gc cannot see); ``other_bytes``, the bytes of the storages of
Python-reachable tensors that are none of the actor's weights, its grad buffers, its optimizer state
(master weights, Adam moments) and the reference's weights; ``param_bytes``, the actor's weights;
``batch_grad``, the fields of the step's batch that carry a graph (forward-only outputs must not).
"""
import gc
import json
import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from saved_tensor_watch import SavedWatch  # noqa: E402

from megarl.roles import optim  # noqa: E402
from megarl.roles.optim import inner_optimizers  # noqa: E402
from megarl.trainer import phases, ppo  # noqa: E402

ROWS, STATE = [], {}


def storage_bytes(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
            try:
                out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except RuntimeError:  # a fake tensor (torch.compile's tracing)
                pass
    return out


def known(trainer) -> dict[int, int]:
    """Storages of the actor's weights, grad buffers and optimizer state, and the reference's weights."""
    actor = trainer.actor
    ddp = actor.trainable.model
    tensors = list(actor.module.parameters())
    tensors += [b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers]
    tensors += [getattr(b, "param_data", None) for b in ddp.buffers + ddp.expert_parallel_buffers]
    for opt in inner_optimizers(actor.trainable.optimizer):
        tensors += [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for st in opt.state.values() for v in st.values()]
    if trainer.ref is not None:
        tensors += list(trainer.ref.module.parameters())
    return storage_bytes(tensors)


def python_reachable() -> dict[int, int]:
    gc.collect()
    return storage_bytes(o for o in gc.get_objects() if isinstance(o, torch.Tensor))


def batch_with_graph(batch) -> list[str]:
    return [k for k, v in vars(batch).items() if isinstance(v, torch.Tensor) and (v.requires_grad or v.grad_fn)]


def main() -> None:
    real_init, real_step, real_update = ppo.PPOTrainer.__init__, optim.Trainable.step, phases.Updater.update

    def init(self, *a, **k):
        real_init(self, *a, **k)
        STATE["trainer"] = self

    def update(self, rollout, *a, **k):
        STATE["batch"] = rollout.batch
        return real_update(self, rollout, *a, **k)

    def step(self, *a, **k):
        t = STATE["trainer"]
        if self is t.actor.trainable:
            saved, saved_bytes = watch.alive()
            mine, reachable = known(t), python_reachable()
            ROWS.append({"saved": saved, "saved_bytes": saved_bytes,
                         "other_bytes": sum(n for p, n in reachable.items() if p not in mine),
                         "param_bytes": sum(p.numel() * p.element_size() for p in t.actor.module.parameters()),
                         "batch_grad": batch_with_graph(STATE["batch"]), "held": watch.describe()})
        return real_step(self, *a, **k)

    ppo.PPOTrainer.__init__, optim.Trainable.step, phases.Updater.update = init, step, update
    sys.argv = ["launch/ppo.py", *sys.argv[1:]]
    with SavedWatch() as watch:
        try:
            runpy.run_path("launch/ppo.py", run_name="__main__")
        finally:
            with open(os.environ["LIVE_MEMORY_OUT"], "w") as f:
                json.dump(ROWS, f)


if __name__ == "__main__":
    main()

"""PPO / GRPO training: torchrun --nproc_per_node N launch/ppo.py yaml/tiny.yaml [key=value ...]

One step: generate -> score -> old/ref log-probs and values -> advantages
-> critic and actor updates -> weights to the engine -> metrics, checkpoint.
SIGTERM / SIGINT: the run finishes its step, saves a checkpoint and exits 0 (resume continues it).
trainer.mode=async: the last placement.rollout_ranks ranks only generate (megarl/trainer/async_rollout.py);
the others run this loop on their batches and push the weights after each update.
"""
import os

import torch.distributed as dist

from megarl.cli import main_guard
from megarl.config import Config
from megarl.trainer.run_config import validate_run
from megarl.launch_common import setup
from megarl.monitor.progress import StepProgress
from megarl.trainer.metrics import console_line


def start_async(cfg, trainer):
    """trainer.mode=async, training ranks: the queue and weight push; the rollout ranks begin."""
    from megarl.trainer.async_train import TrainingEnd

    trainer.pipeline = TrainingEnd(cfg, placement_of(cfg), trainer.actor, trainer.groups)
    trainer.pipeline.start(trainer.step, trainer.sampler.state_dict())


def placement_of(cfg, _held={}):
    """This rank's role under trainer.mode=async (built once, its role's group made the default one)."""
    if "placement" not in _held:
        from megarl.distributed.placement import build_placement

        _held["placement"] = build_placement(cfg.placement.rollout_ranks)
        _held["placement"].enter()
    return _held["placement"]


def end(trainer=None) -> None:
    """Stops the rollout ranks (async) and leaves the process group."""
    if trainer is not None and trainer.pipeline is not None:
        trainer.pipeline.stop()
        placement_of(None).leave()
    dist.destroy_process_group()


def main(argv):
    cfg, rank = setup(argv, Config, validate_run)
    from megarl.trainer.ppo import PPOTrainer
    from megarl.trainer.signals import StopSignal

    if cfg.trainer.mode == "async" and placement_of(cfg).is_rollout:  # this rank only generates
        from megarl.trainer.async_rollout import RolloutWorker

        RolloutWorker(cfg, placement_of(cfg)).run()
        placement_of(cfg).leave()
        return dist.destroy_process_group()
    trainer = PPOTrainer(cfg)
    if cfg.trainer.mode == "async":
        start_async(cfg, trainer)
    if trainer.step >= cfg.trainer.steps:  # resumed a finished run: no second eval row, no re-export
        if rank == 0:
            print(f"the run in {cfg.trainer.run_dir} already finished step {trainer.step} (trainer.steps="
                  f"{cfg.trainer.steps}); nothing to do: raise trainer.steps to go on", flush=True)
        if trainer.exports() and not os.path.isdir(trainer.export_path()):  # killed before its export ended
            trainer.export()
        trainer.close("already_finished")
        return end(trainer)
    stop = StopSignal(trainer.device)
    before = trainer.evaluate() if trainer.step == 0 else None
    if before is not None:
        trainer.writer.write(0, {"eval/accuracy": before})
    bar = StepProgress(cfg.trainer.steps, trainer.step, enabled=rank == 0)  # a bar on a terminal, else lines
    while trainer.step < cfg.trainer.steps:
        rollout = trainer.generate()
        trainer.score(rollout)
        if not cfg.trainer.rollout_only:
            trainer.prepare(rollout)
            trainer.advantages(rollout)
            trainer.update(rollout)
            trainer.sync_weights()
        metrics = trainer.log_and_save(rollout)
        if cfg.trainer.eval_every and trainer.step % cfg.trainer.eval_every == 0:
            accuracy = trainer.evaluate()  # None: no eval set, or a rollout-only run
            if accuracy is not None:
                metrics["eval/accuracy"] = accuracy
                trainer.writer.write(trainer.step, {"eval/accuracy": accuracy})
        bar.update(console_line(trainer.step, cfg.trainer.steps, metrics))
        if trainer.step < cfg.trainer.steps and stop.agreed():
            bar.close()
            trainer.stop_early(stop.received)
            return end(trainer)
    bar.close()
    stop.restore()
    trainer.finish(before)
    end(trainer)


if __name__ == "__main__":
    main_guard(main, cls=Config, usage=__doc__)

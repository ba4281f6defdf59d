"""PPO / GRPO training: torchrun --nproc_per_node N launch/ppo.py yaml/tiny.yaml [key=value ...]

One step: generate -> score -> old/ref log-probs and values -> advantages
-> critic and actor updates -> weights to the engine -> metrics, checkpoint.
SIGTERM / SIGINT: the run finishes its step, saves a checkpoint and exits 0 (resume continues it).
trainer.mode=async: the last placement.rollout_ranks ranks only generate and score (megarl/trainer/async_rollout.py);
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


def enter_placement(cfg):
    """trainer.mode=async: this rank's role (rollout or training), its role's ranks made the default group."""
    from megarl.distributed.placement import build_placement

    placement = build_placement(cfg.placement.rollout_ranks)
    placement.enter()
    return placement


def end(trainer=None, placement=None) -> None:
    """Stops the rollout ranks (async) and leaves the process group."""
    if trainer is not None and trainer.pipeline is not None:
        trainer.pipeline.stop()
    if placement is not None:
        placement.leave()
    dist.destroy_process_group()


def main(argv):
    cfg, rank = setup(argv, Config, validate_run)
    from megarl.trainer.ppo import PPOTrainer
    from megarl.trainer.signals import StopSignal

    placement = enter_placement(cfg) if cfg.trainer.mode == "async" else None
    if placement is not None and placement.is_rollout:  # this rank only generates
        from megarl.trainer.async_rollout import RolloutWorker

        RolloutWorker(cfg, placement).run()
        return end(placement=placement)
    trainer = PPOTrainer(cfg)
    if placement is not None:  # the queue from the rollout ranks, the weight push to them
        from megarl.trainer.async_train import TrainingEnd

        trainer.pipeline = TrainingEnd(cfg, placement, trainer.actor, trainer.groups)
        trainer.pipeline.start(trainer.step, trainer.sampler.state_dict(), trainer.partial)
    if trainer.step >= cfg.trainer.steps:  # resumed a finished run: no second eval row, no re-export
        if rank == 0:
            print(f"the run in {cfg.trainer.run_dir} already finished step {trainer.step} (trainer.steps="
                  f"{cfg.trainer.steps}); nothing to do: raise trainer.steps to go on", flush=True)
        if trainer.exports() and not os.path.isdir(trainer.export_path()):  # killed before its export ended
            trainer.export()
        trainer.close("already_finished")
        return end(trainer, placement)
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
            return end(trainer, placement)
    bar.close()
    stop.restore()
    trainer.finish(before)
    end(trainer, placement)


if __name__ == "__main__":
    main_guard(main, cls=Config, usage=__doc__)

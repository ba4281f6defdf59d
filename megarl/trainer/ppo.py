"""The PPO trainer: every phase of one step as a method, called in order by launch/ppo.py.

Every rank runs the same code. Data-parallel ranks hold different prompts;
the ranks of one TP x PP model replica hold the same prompts and compute the
same results. Nothing is gathered to a driver.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time

import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megarl.algos import AdaptiveKLController, FixedKLController
from megarl.config import Config
from megarl.config_checks import uses_critic, uses_ref
from megarl.data.build import build_eval_sets, build_held_out, build_train_data
from megarl.data.tokenizer import load_tokenizer
from megarl.distributed import build_parallel_groups, device
from megarl.errors import CheckpointError, UserInputError
from megarl.models.exporter import export_hf
from megarl.models.lora import merged_lora
from megarl.models.router_replay import all_stage_layers
from megarl.monitor.curves import plot_curves
from megarl.monitor.progress import note, stage
from megarl.monitor.resources import start_monitor
from megarl.roles.build import build_actor, build_critic, build_reference, build_reward_model
from megarl.rollout.engine import SamplingParams
from megarl.rollout.factory import build_engine, engine_title, training_engine_config
from megarl.trainer import phases
from megarl.trainer.async_channel import rollout_to
from megarl.trainer.checkpoint import Checkpointer, checkpoint_build_meta
from megarl.trainer.correction import rollout_correction_metrics
from megarl.trainer.resume import Layout, rewind_metrics
from megarl.trainer.run_config import check_resume, save_run_config
from megarl.trainer.evaluate import eval_count, held_out_accuracy
from megarl.trainer.eval_sets import evaluate_named_sets
from megarl.trainer.metrics import MetricsWriter, PhaseTimer
from megarl.trainer.rollout import Rollout, generate_rollout, response_metrics
from megarl.trainer.dump import load_rollout, save_rollout
from megarl.trainer.scoring import build_reward, score_metrics, score_rollout
from megarl.trainer.dapo import dynamic_sampling_rollout, mask_truncated, score_and_shape
from megarl.trainer.partial import PartialRollouts, partial_rollout, restore


def sampling_params(cfg: Config) -> SamplingParams:
    """The rollout's sampling settings."""
    r = cfg.rollout
    stops = () if r.ignore_eos else tuple(r.stop_token_ids)
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop_token_ids=stops)


def rollout_seed(cfg: Config, step: int, dp_rank: int) -> int:
    """Step ``step``'s rollout seed: the same in a TP x PP replica, another per step and DP rank."""
    return (cfg.rollout.seed * 1_000_003 + step) * 1009 + dp_rank


def greedy_baseline(cfg: Config, engine, reward, prompts, rollout: Rollout, tokenizer, pad_id: int,
                    device) -> None:
    """ReMax: each prompt's greedy response scored, as ``rollout.batch.greedy_scores`` (one per sample)."""
    r = cfg.rollout
    params = SamplingParams(temperature=0.0, stop_token_ids=tuple(r.stop_token_ids))
    greedy = generate_rollout(engine, prompts, params, tokenizer, pad_id, device, n=1, seed=0,
                              max_new_tokens=r.max_new_tokens)  # greedy: seed unused
    score_rollout(reward, greedy)
    rollout.batch.greedy_scores = greedy.scores.repeat_interleave(r.n)


def _kl_controller(cfg: Config):
    a = cfg.algorithm
    if a.kl_controller == "adaptive":
        return AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
    return FixedKLController(a.kl_coef)


class PPOTrainer:
    """Holds the roles, the engine, the data and the run's state."""

    def __init__(self, cfg: Config):
        started = time.time()  # wall time of this session, for events.jsonl (megarl.report)
        self.cfg = cfg
        p = cfg.parallel
        self.groups = g = build_parallel_groups(p.tp, p.pp, p.cp, p.ep, p.etp)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)
        self.device = device()
        self.rank0 = torch.distributed.get_rank() == 0
        with stage("loading the tokenizer and prompts", self.rank0) as line:
            self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
            self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            self._build_data()
            c = self.train_set.counts
            skipped = [f"{c[k]} {k.replace('_', ' ')}" for k in ("malformed", "too_long") if c.get(k)]
            line.detail = f"{len(self.train_set)} train prompts" + (f"; skipped {', '.join(skipped)}" if skipped else "")
        self.optimizer_steps = cfg.trainer.steps * cfg.actor.ppo_epochs * (
            cfg.data.batch_size * cfg.rollout.n // cfg.actor.mini_batch_size)
        self._build_roles()
        rm_scorer = (lambda b: self.rm.scores(b, cfg.reward.model.micro_batch_size)) if self.rm else None
        sync = cfg.trainer.mode == "sync"  # async: the rollout ranks score (megarl/trainer/async_rollout.py)
        self.reward = build_reward(cfg.reward, rm_scorer, cfg.trainer.run_dir) if sync else None
        self.kl_ctl = _kl_controller(cfg)
        self.checkpointer = Checkpointer(cfg.trainer.run_dir, cfg.trainer.keep_last,
                                         Layout.of(g, cfg.parallel.distributed_optimizer), cfg.trainer.seed,
                                         build=checkpoint_build_meta(cfg))
        if self.rank0 and cfg.trainer.resume:  # rows a killed run logged after its last checkpoint
            rewind_metrics(cfg.trainer.run_dir, self.checkpointer.latest_step())
        self.writer = MetricsWriter(cfg.trainer.run_dir, self.rank0, cfg.trainer.tensorboard, cfg.trainer.wandb,
                                    dataclasses.asdict(cfg))
        self.monitor = start_monitor(cfg.trainer.monitor_interval_s) if self.rank0 else None
        self.step = 0
        self.timer = PhaseTimer()
        self.metrics: dict[str, float] = {}
        self.rollout_stats: dict[str, float] = {}
        self.pipeline = None  # trainer.mode=async: the TrainingEnd (megarl/trainer/async_train.py)
        self.updater = phases.Updater(cfg, self.actor, self.critic, self.kl_ctl, g)  # critic and actor updates
        r = cfg.rollout  # rollout.partial: the groups this rank has in flight between steps
        self.partial = PartialRollouts(cfg.data.batch_size // g.dp_size, r.n, r.partial_batches,
                                       r.max_new_tokens, g.dp_rank) if r.partial else None
        self._resume()
        if self.rank0:
            print(f"run directory {cfg.trainer.run_dir} (resolved config: {save_run_config(cfg)})", flush=True)
        if self.step == 0:  # rows read, malformed (skipped), too long (filtered), kept
            self.writer.write(0, {f"data/{k}": float(v) for k, v in self.train_set.counts.items()})
        self.writer.event("start", self.step, time=started, world_size=torch.distributed.get_world_size())

    # -- setup ---------------------------------------------------------------
    def _build_data(self) -> None:
        cfg, g = self.cfg, self.groups
        self.train_set, self.sampler = build_train_data(cfg.data, self.tokenizer, g.dp_rank, g.dp_size)
        self.eval_set = build_held_out(cfg.data, self.tokenizer)
        self.eval_sets = build_eval_sets(cfg.data, self.tokenizer)

    def _build_roles(self) -> None:
        """Actor, reference, critic, reward model and rollout engine, each with a progress line."""
        cfg, g, say = self.cfg, self.groups, self.rank0
        with stage(f"loading the actor from {cfg.model.path}", say):
            self.actor = build_actor(cfg, g, self.optimizer_steps)
        self.ref = self.critic = self.rm = None
        if uses_ref(cfg):
            shared = cfg.actor.lora.rank and not cfg.ref.path
            what = "the actor's base weights (LoRA adapters off)" if shared else (cfg.ref.path or cfg.model.path)
            with stage(f"loading the reference from {what}", say):
                self.ref = build_reference(cfg, g, self.actor)
        if uses_critic(cfg):
            with stage(f"loading the critic from {cfg.critic.path or cfg.model.path}", say):
                self.critic = build_critic(cfg, g, self.optimizer_steps)
        if cfg.reward.model.path and cfg.trainer.mode == "sync":  # async: the rollout ranks build it
            with stage(f"loading the reward model from {cfg.reward.model.path}", say):
                self.rm = build_reward_model(cfg, g)
        ecfg = training_engine_config(cfg)  # async: it only evaluates
        with stage(f"starting {engine_title(cfg)}", say):
            self.engine = build_engine(ecfg, self.actor, g, self.tokenizer, self._stop_ids(), self.pad_id)

    def _stop_ids(self) -> list[int]:
        if self.cfg.rollout.ignore_eos:
            return []
        eos = self.tokenizer.eos_token_id
        return ([eos] if eos is not None else []) + list(self.cfg.rollout.stop_token_ids)

    def trainable_roles(self) -> dict:
        roles = {"actor": self.actor}
        if self.critic:
            roles["critic"] = self.critic
        return roles

    def _resume(self) -> None:
        step = self.checkpointer.latest_step() if self.cfg.trainer.resume else None
        if step is None:
            return
        forced = check_resume(self.cfg)  # another run's config: refused unless trainer.resume=force
        with stage(f"loading the checkpoint of step {step} from {self.checkpointer.root}", self.rank0):
            state = self.checkpointer.load(step, self.trainable_roles(), expect=("sampler", "kl_controller"))
        self.step = state["step"]
        try:
            self.sampler.load_state_dict(state["sampler"])
        except UserInputError:
            raise
        except ValueError as e:  # the data set changed under the same path
            raise CheckpointError(f"{self.checkpointer.root}/step_{step:06d}: {e} (data.train_path="
                                  f"{self.cfg.data.train_path}); pick a new trainer.run_dir for new data, or set "
                                  f"trainer.resume=false to start over") from None
        self.kl_ctl.load_state_dict(state["kl_controller"])
        if self.partial is not None:
            restore(self.partial, self.checkpointer, step, self.rank0)
        self.engine.update_weights()  # the engine started on other weights (SGLang: dummy ones); sample from these
        if self.rank0:
            print(f"resumed from step {self.step}" + (f" (trainer.resume=force: {'; '.join(forced)})" if forced
                                                      else ""), flush=True)

    # -- the phases of a step ------------------------------------------------
    def sampling_params(self) -> SamplingParams:
        return sampling_params(self.cfg)

    def sampling_seed(self) -> int:
        """This step's rollout seed (:func:`rollout_seed`)."""
        return rollout_seed(self.cfg, self.step, self.groups.dp_rank)

    def generate(self) -> Rollout:
        self.timer = PhaseTimer()
        self.metrics = {}  # this step's values that are the same on every rank (grad norms, beta, ...)
        self.step_start = time.perf_counter()
        t = self.cfg.trainer
        if t.replay_rollouts:
            rollout = load_rollout(t.replay_rollouts, self.step + 1, self.groups.dp_rank, self.device)
            rollout.metrics.update(response_metrics(rollout))
            return rollout
        if self.pipeline is not None:  # trainer.mode=async: the rollout ranks generated and scored it
            return self._queued_rollout()
        if self.cfg.algorithm.dapo.dynamic_sampling:  # generates and scores rounds until the batch is full
            rollout = dynamic_sampling_rollout(self)
        elif self.partial is not None:  # the first whole groups to finish; the rest carry over
            rollout = partial_rollout(self)
        else:
            rollout = self.generate_prompts(self.sampler.next_batch(self.train_set), self.sampling_seed())
        self.rollout_stats = dict(self.engine.stats)  # this rank's engine counters (not DP-summed)
        rollout.metrics.update(response_metrics(rollout))
        return rollout

    def _queued_rollout(self) -> Rollout:
        """This step's batch from the rollout ranks; the sampler stands where theirs did after it (for checkpoints)."""
        with self.timer("rollout_wait"):
            queued = self.pipeline.next_batch(self.step)
        self.sampler.load_state_dict(queued.sampler_state)  # dynamic sampling drew a round's prompts or more
        if self.partial is not None:  # the rollout replica's groups in flight, saved with checkpoints
            self.partial.load_state_dict(queued.partial_state)
        rollout = rollout_to(queued.rollout, self.device)
        self.rollout_stats = dict(queued.engine_stats)
        self.metrics.update(queued.step_metrics)
        rollout.metrics.update(response_metrics(rollout))
        return rollout

    def generate_prompts(self, prompts, seed: int) -> Rollout:
        """This rank's prompts generated ``rollout.n`` times each from ``seed``."""
        with self.timer("rollout"):
            self.engine.resume_memory()
            r = self.cfg.rollout
            rollout = generate_rollout(self.engine, prompts, self.sampling_params(), self.tokenizer, self.pad_id,
                                       self.device, n=r.n, seed=seed, max_new_tokens=r.max_new_tokens)
            rollout.batch.policy_version = self.step  # the weights after this many steps sampled it
            rollout.batch.expert_ids = all_stage_layers(rollout.batch.expert_ids, self.groups)  # MoE: every stage's
            if self.cfg.algorithm.advantage == "remax":
                self._greedy_baseline(prompts, rollout)
            self.engine.release_memory()
        return rollout

    def _greedy_baseline(self, prompts, rollout: Rollout) -> None:
        greedy_baseline(self.cfg, self.engine, self.reward, prompts, rollout, self.tokenizer, self.pad_id,
                        self.device)

    def score(self, rollout: Rollout) -> None:
        """Rewards and DAPO's overlong shaping (kept as they are for replayed rollouts that carry
        scores, and for dynamic sampling, which scored while generating); DAPO's truncated
        responses masked; dumps if asked."""
        with self.timer("reward"):
            if rollout.scores is None:
                dapo, limit = self.cfg.algorithm.dapo, self.cfg.rollout.max_new_tokens
                rollout.metrics.update(score_and_shape(self.reward, rollout, dapo, limit))
            elif self.cfg.trainer.replay_rollouts:
                rollout.metrics.update(score_metrics(rollout.scores))
        if self.cfg.algorithm.dapo.mask_truncated:
            mask_truncated(rollout)
        if self.cfg.trainer.dump_rollouts:
            save_rollout(rollout, self.cfg.trainer.dump_rollouts, self.step + 1, self.groups)

    def prepare(self, rollout: Rollout) -> None:
        """Old and reference log-probs and values, with the weights that generated."""
        self.metrics.update(phases.prepare(rollout, self.cfg, self.step, self.groups.dp_size, self.actor, self.ref,
                                           self.critic, self.timer))

    def advantages(self, rollout: Rollout) -> None:
        with self.timer("advantage"):
            self.metrics.update(phases.advantages(rollout, self.cfg.algorithm, self.kl_ctl, self.groups))

    def update(self, rollout: Rollout) -> None:
        self.updater.update(rollout, self.step, self.timer, self.metrics)
        dp = self.groups.dp if self.groups.dp_size > 1 else None
        self.metrics.update(rollout_correction_metrics(rollout.batch, self.actor.correction, dp))

    def sync_weights(self) -> None:
        with self.timer("weight_sync"):
            self.metrics.update(self.engine.update_weights())
            if self.pipeline is not None:  # trainer.mode=async: the rollout ranks' copies too
                self.metrics.update(self.pipeline.push(self.step + 1))

    def evaluate(self) -> float | None:
        """The named eval sets (written as eval/<name>/... at this step), then the held-out
        accuracy, which is returned; None without data.eval_path. A rollout-only run evaluates
        nothing (the model never changes)."""
        if self.cfg.trainer.rollout_only:
            return None
        self.evaluate_sets()
        if self.eval_set is None:
            return None
        count, start = eval_count(len(self.eval_set), self.cfg.trainer.eval_samples), time.perf_counter()
        note(f"evaluating {count} held-out prompts ...", self.rank0)
        acc = held_out_accuracy(self.engine, self.eval_set, self.tokenizer, self.groups,
                                self.cfg.rollout.max_new_tokens, self.cfg.trainer.eval_samples)
        note(f"held-out accuracy {acc:.3f} on {count} prompts ({time.perf_counter() - start:.1f} s)", self.rank0)
        return acc

    def evaluate_sets(self) -> dict[str, float]:
        """data.eval_sets: n samples per prompt, pass@k and mean@n (megarl/trainer/eval_sets.py)."""
        metrics = evaluate_named_sets(self.cfg, self.engine, self.eval_sets, self.tokenizer, self.groups, self.rank0)
        if metrics:
            self.writer.write(self.step, metrics)
        return metrics

    def log_and_save(self, rollout: Rollout) -> dict[str, float]:
        self.step += 1
        metrics = phases.step_metrics(rollout, self.groups, self.metrics, self.timer, self.step_start)
        metrics.update(self.rollout_stats)
        if self.monitor:  # rank 0's node only
            metrics.update(self.monitor.drain())
        self.writer.write(self.step, metrics)
        t = self.cfg.trainer
        last = self.step == t.steps and t.save_last
        if not t.rollout_only and (last or (t.save_every and self.step % t.save_every == 0)):
            self.save()
        if not t.rollout_only and t.export_every and self.step % t.export_every == 0:
            self.export(os.path.join(t.run_dir, "exports", f"step_{self.step:06d}"))
        return metrics

    def finish(self, accuracy_before: float | None) -> None:
        """Held-out accuracy after training (beside the one before), HF export, close logs."""
        after = self.evaluate()
        if after is not None:
            self.writer.write(self.step, {"eval/accuracy": after})
            if self.rank0:
                before = "n/a (resumed)" if accuracy_before is None else f"{accuracy_before:.3f}"
                print(f"held-out accuracy: before {before}  after {after:.3f}", flush=True)
        if self.exports():
            self.export()
        self.close("end")

    def exports(self) -> bool:
        """Whether the run ends with an HF export (trainer.export_hf; a rollout-only run trains nothing)."""
        return self.cfg.trainer.export_hf and not self.cfg.trainer.rollout_only

    def export_path(self) -> str:
        return os.path.join(self.cfg.trainer.run_dir, "hf")

    def export(self, out: str | None = None) -> None:
        """The actor as a Hugging Face directory (``out``, default ``RUN_DIR/hf``), with a progress
        line and an event.

        Written to ``<out>.partial`` and renamed when complete, so a kill mid-export never leaves a
        half-written ``hf`` (a restart of the finished run exports again)."""
        out = out or self.export_path()
        partial = out + ".partial"
        if self.rank0 and os.path.exists(partial):
            shutil.rmtree(partial)
        torch.distributed.barrier()
        with stage(f"exporting the actor to {out}", self.rank0) as line:
            with merged_lora(self.actor.module):  # plain weights W + s B A (no adapters: a no-op)
                written = export_hf(self.actor.module, self.actor.info, self.groups, partial,
                                    copy_from=self.cfg.model.tokenizer or self.cfg.model.path)
            if self.rank0:
                if os.path.exists(out):
                    shutil.rmtree(out)
                os.replace(partial, out)
            torch.distributed.barrier()
            if written is not None:
                line.detail = f"{written.tensors} tensors, {written.bytes / 2**20:.1f} MB"
        if written is not None:
            self.writer.event("export", self.step, path=os.path.abspath(out), tensors=written.tensors,
                              bytes=written.bytes)

    def close(self, event: str) -> None:
        """Stops the resource monitor, logs how the session ended (end, stopped, already_finished), draws
        curves.png after training, closes the logs."""
        if self.monitor:
            self.monitor.stop()
        self.writer.event(event, self.step)
        if self.rank0 and event != "already_finished":
            plot_curves(self.cfg.trainer.run_dir)
        self.writer.close()

    def stop_early(self, signal_name: str | None) -> None:
        """A stop signal: save this step (unless just saved) and close; resume picks it up."""
        if not self.cfg.trainer.rollout_only and self.checkpointer.latest_step() != self.step:
            self.save()
        self.close("stopped")
        if self.rank0:
            why = signal_name or "a stop signal on another rank"
            print(f"stopped by {why} after step {self.step}; checkpoint saved in "
                  f"{self.checkpointer.root} (run the same command to resume)", flush=True)

    def save(self) -> None:
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "kl_controller": self.kl_ctl.state_dict()}
        rank_files = {"partial": self.partial.state_dict()} if self.partial is not None else {}
        self.checkpointer.save(self.step, self.trainable_roles(), state, rank_files)

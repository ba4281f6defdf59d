"""The rollout ranks of ``trainer.mode=async``: generate, score, queue; take new weights between steps.

A rollout rank holds its own copy of the policy (TP ``placement.rollout_tp`` over the rollout
ranks) and the native engine on it, or, with ``rollout.engine=sglang``, an SGLang engine per rollout
TP group and no Megatron copy (the pushed HF tensors go straight into SGLang). Its loop, for
training steps ``k = start .. steps-1``:

    wait for weights of version >= k - min(async.max_staleness, async.queue_size - 1)
    generate and score batch k (the prompts and seed the synchronous run would use at step k)
    send it to the training ranks of its data-parallel replica (asynchronous: the queue)

Weights arrive only between batches (:class:`~megarl.trainer.weight_push.WeightReceiver` copies them
into the parameters the native engine reads; SGLang loads them in one weight-update session and flushes
its radix cache; neither engine is restarted). A version older than the bound
is never used: the rank waits instead (``async/rollout_waits``). The training ranks push a version
after every update; ``version >= k - queue_size + 1`` also means the trainer has taken batch
``k - queue_size``, so at most ``queue_size`` batches are in flight. With ``max_staleness=0`` batch k
is sampled by the weights after k updates, exactly as in synchronous training.

Rewards are computed here, on the rollout ranks, not by the trainer after the queue: a reward
model (``reward.model.path``) is built beside the policy copy at the rollout layout (TP
``placement.rollout_tp``, frozen, resident on the device as in the synchronous run) and scores each
batch right after the engine released its memory, like the synchronous step. Three reasons: DAPO's
dynamic sampling must know the scores to decide whether to generate another round, and rounds are
generated here; ReMax's greedy baseline is a generation too; and the training ranks keep their
device memory and their time for the update while the queue carries (B,) scores. Only the rollout
ranks build the reward model in async mode (the training ranks hold no copy). Its out-of-memory
retries are agreed within one rollout replica (:class:`~megarl.roles.value.RewardModel`), so a
replica that is already full in a dynamic-sampling round need not score alongside the others.

Dynamic sampling (``algorithm.dapo.dynamic_sampling``) runs the synchronous rounds
(:func:`megarl.trainer.dapo.sample_until_full`: the same seeds, cap and counts); the rollout
replicas agree on each round among themselves (their data-parallel group of the rollout sub-world),
as the synchronous DP ranks do. The batch carries the dapo/* counts and the prompt sampler's
position after its rounds, which the training ranks adopt (their checkpoints then resume the
rollout ranks at the right prompt).

Partial rollouts (``rollout.partial``) keep the unfinished groups on the rollout replica between
batches (:mod:`megarl.trainer.partial`); a token's version is the one this rank held when it
sampled it. ``async.max_staleness`` bounds the oldest token of a batch: before batch k, responses
holding a token older than ``k - max_staleness`` are sampled again from their seed. Each batch
carries the groups in flight after it; the training ranks checkpoint them and the start message
gives them back.
"""
from __future__ import annotations

import dataclasses
import functools
import signal
from types import SimpleNamespace

from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megarl.config import Config
from megarl.data.build import build_train_data
from megarl.data.tokenizer import load_tokenizer
from megarl.distributed import build_parallel_groups, device
from megarl.distributed.placement import Placement
from megarl.models.hf_config import read_hf_config
from megarl.models.weight_map import expected_hf_names
from megarl.roles.build import build_module, build_reward_model
from megarl.rollout.factory import base_engine, wrap_engine
from megarl.trainer.async_channel import BATCH_TAG, START_TAG, Outbox, QueuedBatch, recv_object, rollout_to, \
    send_object
from megarl.trainer.dapo import sample_until_full, score_and_shape
from megarl.trainer.partial import PartialRollouts, generate_and_take, pack_taken
from megarl.trainer.ppo import greedy_baseline, rollout_seed, sampling_params
from megarl.trainer.rollout import Rollout, generate_rollout
from megarl.trainer.scoring import build_reward
from megarl.trainer.weight_push import PushReceiver, WeightReceiver, push_sources


def rollout_config(cfg: Config) -> Config:
    """The config the rollout ranks build their policy copy with: TP placement.rollout_tp, no PP / CP / EP
    (every expert on each rollout rank), no LoRA adapters (the push sends W + s B A merged); SGLang never
    released (nothing trains on these GPUs, and its weights come only from the pushes)."""
    p = dataclasses.replace(cfg.parallel, tp=cfg.placement.rollout_tp, pp=1, cp=1, ep=1, etp=None,
                            sequence_parallel=False)
    actor = dataclasses.replace(cfg.actor, lora=dataclasses.replace(cfg.actor.lora, rank=0))
    sglang = dataclasses.replace(cfg.rollout.sglang, enable_memory_saver=False, weights_cpu_backup=False)
    return dataclasses.replace(cfg, parallel=p, actor=actor, rollout=dataclasses.replace(cfg.rollout, sglang=sglang))


def lag_bound(cfg: Config) -> int:
    """The most policy versions a batch lags the step that trains it."""
    return min(cfg.async_.max_staleness, cfg.async_.queue_size - 1)


class RolloutWorker:
    """One rollout rank: its policy copy, engine, prompts and rewards."""

    def __init__(self, cfg: Config, placement: Placement):
        self.cfg, self.placement = rollout_config(cfg), placement
        cfg = self.cfg
        self.groups = g = build_parallel_groups(cfg.parallel.tp, 1, 1)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.train_set, self.sampler = build_train_data(cfg.data, self.tokenizer, g.dp_rank, g.dp_size)
        eos = self.tokenizer.eos_token_id
        stops = [] if cfg.rollout.ignore_eos else ([eos] if eos is not None else []) + list(cfg.rollout.stop_token_ids)
        module, info = (None, read_hf_config(cfg.model.path)) if cfg.rollout.engine == "sglang" else \
            build_module(cfg.model.path, cfg, g)  # SGLang holds the weights itself: no Megatron copy
        if module is not None:
            module.eval()
        engine = base_engine(cfg, SimpleNamespace(module=module, info=info), g, stops, self.pad_id)
        self.engine = wrap_engine(cfg, engine, self.tokenizer, g, stops, self.pad_id)
        self.rm = build_reward_model(cfg, g) if cfg.reward.model.path else None  # at the rollout layout
        rm_scorer = (lambda b: self.rm.scores(b, cfg.reward.model.micro_batch_size)) if self.rm else None
        self.reward = build_reward(cfg.reward, rm_scorer, cfg.trainer.run_dir)
        self.device = device()
        ranks = placement.directory({"dp_rank": g.dp_rank, "tp_rank": g.tp_rank})
        self._take_push = self._push_taker(engine, module, info, push_sources(ranks))
        self.targets = [r["rank"] for r in ranks if r["role"] == "train" and r["dp_rank"] == g.dp_rank]
        self.starter = next(r["rank"] for r in ranks if r["role"] == "train" and r["dp_rank"] == g.dp_rank
                            and r["tp_rank"] == r["pp_rank"] == r["cp_rank"] == 0)  # sends the first step, sampler
        self.sends = g.tp_rank == 0  # one rank of a rollout replica sends its batches
        self.in_flight: list[tuple[int, Outbox]] = []  # (step, its sends) not yet known to be taken
        r = cfg.rollout  # rollout.partial: this replica's groups in flight (the start message restores them)
        self.partial = PartialRollouts(cfg.data.batch_size // g.dp_size, r.n, r.partial_batches,
                                       r.max_new_tokens, g.dp_rank) if r.partial else None

    def _push_taker(self, engine, module, info, sources: list[int]):
        """A function that blocks for the next weight push, applies it and returns its version (None: a
        stop). Native: each push is cut into the Megatron copy the engine decodes on, then the engine forgets
        its prefix cache. SGLang (``module`` None): each push's HF tensors go into SGLang as they arrive."""
        if module is None:
            wire = PushReceiver(expected_hf_names(info), self.placement, sources, self.device)
            return lambda: wire.receive(engine.load_weights)
        receiver = WeightReceiver(module, info, self.groups, self.placement, sources)

        def take() -> int | None:
            version = receiver.receive()
            if version is not None:
                engine.update_weights()  # the prefix cache held K/V of the old weights
            return version
        return take

    def run(self) -> None:
        """Generates until the trainer's last step or its stop; ignores SIGINT / SIGTERM (the training
        ranks decide when the run stops and say so)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        start = recv_object(self.placement.objects, self.starter, START_TAG)
        step = start["step"]
        self.sampler.load_state_dict(start["sampler"])
        if self.partial is not None:  # the checkpoint's groups in flight (none: a fresh run or a new layout)
            self.partial.load_state_dict(start["partial"])
            self.partial.dropped = start["partial_dropped"]
        version = self._receive()
        while version is not None and step < self.cfg.trainer.steps:
            need, waits = step - lag_bound(self.cfg), 0
            while version is not None and version < need:
                version, waits = self._receive(), waits + 1
            if version is None:
                break
            self._send(self._generate(step, version, waits))
            step += 1
        while version is not None:  # the pushes after the last steps, until the trainer's stop
            version = self._receive()

    def _receive(self) -> int | None:
        version = self._take_push()
        if version is not None:
            for _, outbox in [b for b in self.in_flight if b[0] < version]:  # taken before that update
                outbox.wait()
            self.in_flight = [b for b in self.in_flight if b[0] >= version]
        return version

    def _generate(self, step: int, version: int, waits: int) -> QueuedBatch:
        """Batch ``step``: generated with weights ``version``, scored and shaped (dynamic sampling: by rounds)."""
        cfg, g = self.cfg, self.groups
        seed, step_metrics = rollout_seed(cfg, step, g.dp_rank), {}
        sample = functools.partial(self._sample, version=version)  # (prompts, seed) -> Rollout
        if self.partial is not None:
            rollout, step_metrics = self._partial(step, version, seed)
        elif cfg.algorithm.dapo.dynamic_sampling:
            dp = g.dp if g.dp_size > 1 else None
            rollout, step_metrics = sample_until_full(cfg, self.reward, lambda: self.sampler.next_batch(self.train_set),
                                                      sample, seed, g.dp_size, dp)
        else:
            rollout = sample(self.sampler.next_batch(self.train_set), seed)
            rollout.metrics.update(score_and_shape(self.reward, rollout, cfg.algorithm.dapo,
                                                   cfg.rollout.max_new_tokens))
        stats = dict(self.engine.stats)
        stats["async/rollout_waits"] = float(waits)
        return QueuedBatch(step=step, version=version, rollout=rollout_to(rollout, "cpu"), engine_stats=stats,
                           step_metrics=step_metrics, sampler_state=self.sampler.state_dict(),
                           partial_state=None if self.partial is None else self.partial.state_dict())

    def _partial(self, step: int, version: int, seed: int) -> tuple[Rollout, dict[str, float]]:
        """Batch ``step`` of partial rollouts: samples begun before version ``step - async.max_staleness``
        start over (no token of the batch is older than the bound), the rest continue under ``version``."""
        cfg, g, p = self.cfg, self.groups, self.partial
        p.restart_older_than(step - cfg.async_.max_staleness)
        taken = generate_and_take(p, self.engine, lambda: self.sampler.next_batch(self.train_set),
                                  sampling_params(cfg), seed, version)
        rollout, metrics = pack_taken(p, taken, step, self.tokenizer, self.pad_id, self.device,
                                      g.dp if g.dp_size > 1 else None)
        rollout.metrics.update(score_and_shape(self.reward, rollout, cfg.algorithm.dapo, cfg.rollout.max_new_tokens))
        return rollout, metrics

    def _sample(self, prompts, seed: int, version: int) -> Rollout:
        """``prompts`` generated ``rollout.n`` times each from ``seed`` (ReMax: and greedily once, scored)."""
        cfg, r = self.cfg, self.cfg.rollout
        self.engine.resume_memory()
        rollout = generate_rollout(self.engine, prompts, sampling_params(cfg), self.tokenizer, self.pad_id,
                                   self.device, n=r.n, seed=seed, max_new_tokens=r.max_new_tokens)
        rollout.batch.policy_version = version
        if cfg.algorithm.advantage == "remax":
            greedy_baseline(cfg, self.engine, self.reward, prompts, rollout, self.tokenizer, self.pad_id,
                            self.device)
        self.engine.release_memory()
        return rollout

    def _send(self, batch: QueuedBatch) -> None:
        if self.sends:
            outbox = Outbox()
            for dst in self.targets:
                send_object(self.placement.objects, batch, dst, BATCH_TAG, outbox)
            self.in_flight.append((batch.step, outbox))

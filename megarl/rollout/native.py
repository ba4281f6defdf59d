"""megarl's native rollout engine: continuous batching on the actor's own Megatron weights.

Per ``generate`` call, as a loop of schedule -> run -> record (:mod:`megarl.rollout.loop`):

- **schedule**: requests (one sample each, with its own seed) go to a
  :class:`~megarl.rollout.scheduler.Scheduler` over a paged KV cache — requests
  whose prompts are identical, wherever they are in the list, as one group whose
  prompt is prefilled once and whose other members fork its pages; each step it
  plans a chunked prefill (which also decodes the running sequences: a mixed
  step, ``rollout.mixed_prefill``) or a decode;
- **run**: a :class:`~megarl.rollout.runners.StepRunner` runs the plan — eagerly
  (the stage forward of :mod:`megarl.rollout.stage`; every step on CPU, the
  tested reference), or replaying CUDA graphs for decode steps and small
  prefills (``graphs.py``, ``prefill_graphs.py``) — and the fused sampler
  (``megarl_kernels.sampling``) picks each request's next token from its seed
  and token index alone, so a request's tokens do not depend on the batch it
  ran in;
- **record**: the scheduler appends the tokens and ends finished sequences.

``serve`` is ``generate`` for a caller that answers finished requests with new
ones while the rest decode (the agent loop's tool calls): between steps it
hands out what finished and queues what the caller sends back.

``generate_until`` is ``generate`` that stops once the caller's predicate over
the finished requests says enough (partial rollouts, ``rollout.partial``): the
unfinished ones come back with the tokens they sampled so far, and a later call
resumes each from its ``Request.prefix``. Their K/V is not kept: the resumed
request is prefilled again (prompt + prefix) under the weights of that call —
K/V computed by older weights would make the new tokens condition on a state
no single policy computed — while the prefix's tokens and log-probs stay those
of the policy that sampled them.

With TP every rank of the group runs the same scheduler and gathers the
logits; with PP hidden states go stage to stage and the last stage broadcasts
the sampled tokens to its pipeline group. The engine itself holds what every
runner shares: the KV cache, the graphs and the stage's forward pieces
(:meth:`NativeEngine.compute`, the p2p of hidden states, the broadcast of tokens).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megarl.config import RolloutConfig
from megarl.errors import ConfigError
from megarl.distributed import ParallelGroups, cpu_compat
from megarl.rollout.engine import FollowUps, GenerationResult, Request, SamplingParams
from megarl.rollout.graphs import DecodeGraphs
from megarl.rollout.loop import StepCounters, StepLoop
from megarl.rollout.pages import KVCache, KVLayout, PagePool, pages_for, pool_pages
from megarl.rollout.prefill_graphs import PrefillGraphs
from megarl.rollout.runners import EagerRunner, GraphRunner, PipelineGraphRunner, SamplingRows, StepRunner
from megarl.rollout.scheduler import Scheduler, Sequence
from megarl.rollout.stage import ForwardBatch, StageForward
from megarl.rollout.step_experts import record_layout, sequence_expert_ids

GROUP_IDLE_S = 0.001  # EP across DP, every rank idle and some waiting for follow-ups: pause between agreements

def _rollout_default(key: str):
    """``rollout.<key>``'s default, read from :class:`~megarl.config.RolloutConfig` (its one source)."""
    return next(f.default for f in fields(RolloutConfig) if f.name == key)


@dataclass(frozen=True)
class EngineOptions:
    """Sizes of the engine: the ``rollout.*`` keys of the same names (documented there, defaults
    read from there), and the longest sequence the graphs are sized for."""

    max_batch: int = _rollout_default("max_batch")
    page_size: int = _rollout_default("page_size")
    max_num_batched_tokens: int = _rollout_default("max_num_batched_tokens")
    kv_cache_gb: float = _rollout_default("kv_cache_gb")
    kv_cache_fraction: float = _rollout_default("kv_cache_fraction")
    cuda_graphs: bool = _rollout_default("cuda_graphs")
    prefix_cache: bool = _rollout_default("prefix_cache")
    mixed_prefill: bool = _rollout_default("mixed_prefill")
    max_model_len: int = 0  # longest prompt + response the graphs are sized for; 0: the model's maximum
    record_experts: bool = _rollout_default("record_experts")  # GenerationResult.expert_ids

    @classmethod
    def from_config(cls, rollout: RolloutConfig, max_model_len: int = 0) -> "EngineOptions":
        """The options a run's ``rollout`` section sets."""
        return cls(**{f.name: getattr(rollout, f.name) for f in fields(cls) if f.name != "max_model_len"},
                   max_model_len=max_model_len)


class NativeEngine:
    """Rollout on the actor's Megatron stage, all TP/PP peers decoding together."""

    def __init__(self, module, groups: ParallelGroups, vocab_size: int, eos_ids: list[int],
                 pad_id: int, options: EngineOptions = EngineOptions()):
        self.module, self.groups, self.options = module, groups, options
        self.vocab_size = vocab_size  # real vocabulary; padded rows are never sampled
        self.eos_ids, self.pad_id = list(eos_ids), pad_id
        self.device = next(module.parameters()).device
        self.stage = StageForward(module, groups, vocab_size)
        cfg = module.config
        self.layout = KVLayout(len(self.stage.layers), self.stage.kv_heads, self.stage.head_dim,
                               options.page_size, cfg.params_dtype)
        self.max_len = min(options.max_model_len or module.max_sequence_length, module.max_sequence_length)
        self.cache: KVCache | None = None
        # EP across DP: decode graphs replayed by the whole EP group at its agreed bucket (moe_step.py; the captured
        # path there is unverified on a GPU)
        use_graphs = options.cuda_graphs and self.device.type == "cuda"
        self.graphs = DecodeGraphs(self, options.max_batch) if use_graphs else None
        self.prefill_graphs = PrefillGraphs(self, self.graphs) if use_graphs else None
        self.stats: dict[str, float] = {}

    # -- RolloutEngine -------------------------------------------------------
    def generate(self, requests: list[Request], params: SamplingParams) -> list[GenerationResult]:
        """One result per request, in request order, under its key; each request samples from its own
        seed (as is) and stops after its ``max_new_tokens``.

        Requests with identical prompts (by content, anywhere in the list) are one group: the first is
        prefilled, the others fork its pages (copy-on-write), so an n-fold batch
        (:func:`~megarl.rollout.engine.sample_requests`) prefills each prompt once. A request's tokens
        do not depend on its group, position or batch (the sampler reads its seed and token index).
        """
        seqs, longest = self._sequences(requests)
        sched = self._run(seqs, params, longest, None)
        by_key = {s.rid: s for s in sched.done}
        return [self._result(by_key[r.key]) for r in requests]

    def generate_until(self, requests: list[Request], params: SamplingParams,
                       enough: Callable[[list[int]], bool]) -> tuple[list[GenerationResult], list[GenerationResult]]:
        """``generate`` that stops early: before each step ``enough(keys)`` is told the keys of the requests
        finished since its last call (in the order they ended) and returns True to stop. Returns (finished,
        unfinished) results; an unfinished one (finish_reason "unfinished") holds every token its request
        sampled, prefix included — a request built from it (``prefix`` = its tokens) continues it, the
        same tokens as if it had never stopped when the weights have not changed. Every TP / PP peer calls
        ``enough`` with the same keys at the same steps, so they stop together."""
        seqs, longest = self._sequences(requests)
        seen = [0]

        def stop(sched: Scheduler) -> bool:
            new, seen[0] = sched.done[seen[0]:], len(sched.done)
            return enough([s.rid for s in new])

        sched = self._run(seqs, params, longest, None, stop=stop)
        finished = {s.rid: s for s in sched.done}
        unfinished = {s.rid: s for s in sched.unfinished()}
        for seq in unfinished.values():  # their pages go back (a pool kept between calls would leak them)
            sched.pool.release(seq.pages)
            seq.pages = []
        return ([self._result(finished[r.key]) for r in requests if r.key in finished],
                [replace(self._result(unfinished[r.key]), finish_reason="unfinished")
                 for r in requests if r.key in unfinished])

    def serve(self, requests: list[Request], params: SamplingParams, feed: FollowUps,
              reserve: tuple[int, int] = (0, 0)) -> None:
        """``generate``'s requests (grouped the same way), each result handed to ``feed.finished`` as soon
        as its last token is recorded; between steps ``feed.poll`` may add requests (one sample each,
        seed as is, ``params``' sampling), which join the waiting queue alone and are admitted like
        refills. Returns when nothing runs and ``feed.poll(idle=True)`` gives nothing. Every request must
        fit the longest initial prompt + limit (the KV cache and the graphs are sized for it); each one's
        tokens depend on its seed and prompt only, as in ``generate``.

        ``reserve = (sequences, longest)``: size the call for that many follow-ups of up to ``longest``
        tokens as well (a caller whose requests all arrive as follow-ups passes ``requests=[]``)."""
        seqs, longest = self._sequences(requests, reserve[1])
        group_step = self.serve_group_step if self.stage.ep is not None else None
        self._run(seqs, params, longest, _Feed(feed, longest, group_step), reserve=reserve[0] * longest)

    def _sequences(self, requests: list[Request], at_least: int = 0) -> tuple[list[Sequence], int]:
        """A sequence per request (``rid`` = its key, ``prompt_index`` = its prompt's group: the order in
        which distinct prompts + prefixes first appear) and the longest prompt + limit."""
        if len({r.key for r in requests}) != len(requests):
            raise ValueError("rollout requests: every request of a call needs its own key")
        for r in requests:
            if len(r.prefix) != len(r.prefix_logprobs) or len(r.prefix) >= r.max_new_tokens:
                raise ValueError(f"request {r.key}: a prefix of {len(r.prefix)} tokens with {len(r.prefix_logprobs)} "
                                 f"log-probs under max_new_tokens {r.max_new_tokens}: one log-prob per token, and "
                                 "fewer tokens than the limit")
        groups: dict[tuple, int] = {}
        seqs = [Sequence(r.key, groups.setdefault((tuple(r.prompt), tuple(r.prefix)), len(groups)), list(r.prompt),
                         r.seed, r.max_new_tokens, generated=list(r.prefix), logprobs=list(r.prefix_logprobs))
                for r in requests]
        longest = max([len(r.prompt) + r.max_new_tokens for r in requests] + [at_least])
        if longest > self.module.max_sequence_length:
            raise ValueError(f"prompt + max_new_tokens = {longest} exceeds the model's "
                             f"{self.module.max_sequence_length} positions; lower rollout.max_new_tokens")
        return seqs, longest

    def _run(self, seqs: list[Sequence], params: SamplingParams, longest: int, feed: "_Feed | None",
             reserve: int = 0, stop: Callable[[Scheduler], bool] | None = None) -> Scheduler:
        """Schedule -> run -> record until every sequence is done (or ``stop`` says enough); the scheduler
        holds them (``done``). ``reserve``: tokens of follow-ups to size the KV cache for besides ``seqs``."""
        sched = self._scheduler(seqs, params, longest, every_prompt=feed is not None, reserve=reserve)
        runner = self._runner(SamplingRows(params, self.device), longest)
        # no module.eval(): the engine reads the weights, never calls a module (a train/eval walk over
        # every module would cost host time per call)
        try:
            with torch.no_grad(), cpu_compat.paused():
                self.stage.refresh_experts()
                counters = StepLoop(sched, runner, feed, stop).run()
                self.serve_group_until_done()  # EP across DP: serve the group's other ranks until they are done too
        except BaseException:
            self._drop_pool()
            raise
        self._record(sched, counters)
        return sched

    def _drop_pool(self) -> None:
        """A call cut short (an error, an interrupt) leaves pages held by its sequences and may leave
        cached pages whose K/V (and expert ids) its steps never wrote: a later call starts on a fresh
        pool, so nothing reads them."""
        if self.cache is not None:
            self.cache.pool = PagePool(self.cache.pool.num_pages)

    def serve_group_until_done(self) -> None:
        """EP across DP, this rank done: its experts serve the group's other ranks, step by step as agreed
        (``EpStep.agree``), until no rank has a step to run or waits for follow-ups."""
        if self.stage.ep is not None:
            while self.serve_group_step(waiting=False):
                pass

    def serve_group_step(self, waiting: bool) -> bool:
        """EP across DP, nothing of this rank's to run (``waiting``: but follow-ups may come): one agreement
        and, if some rank has a step, this rank's part of it — the agreed bucket's decode graph with no
        real rows on a graph step, idle MoE layers on an eager one. False once no rank has a step or waits."""
        shape = self.stage.ep.agree(0, graph_ok=self.graphs is not None, waiting=waiting)
        if shape.rows and shape.graph:
            self.graphs.idle(shape.rows)
        elif shape.rows:
            self.stage.idle_step()
        elif shape.waiting:
            time.sleep(GROUP_IDLE_S)  # every rank idle, some waiting for follow-ups: agree again shortly
        return bool(shape.rows or shape.waiting)

    def update_weights(self) -> dict:
        """The engine reads the training weights in place: nothing to move (graphs check pointers)."""
        if self.graphs is not None:
            self.graphs.shared.check_weights()
        if self.cache is not None:
            self.cache.pool.forget()  # cached K/V were computed with the old weights
        return {"weight_sync/bytes": 0.0, "weight_sync/zero_copy": 1.0}

    def release_memory(self) -> None:
        """Gives the KV cache's memory back before training (a pinned cache keeps its address)."""
        if self.cache is not None and self.cache.storage is not None:
            self.cache.release()  # unmapped: the prefix cache goes with it
            self.cache.pool.forget()
        elif self.cache is not None and self.graphs is None:
            self.cache = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Maps a released pinned cache again (generate also does it when needed)."""
        if self.cache is not None and self.cache.storage is not None:
            self.cache.resume()

    # -- scheduling and the KV cache -------------------------------------------
    def _scheduler(self, seqs: list[Sequence], params: SamplingParams, longest: int,
                   every_prompt: bool = False, reserve: int = 0) -> Scheduler:
        """A scheduler holding ``seqs`` as prefill-sharing groups (see :meth:`_prefill_groups`), its KV
        pool sized for each group's prompt once; ``every_prompt``: for a prompt per sequence instead
        (``serve``: follow-ups share nothing)."""
        o = self.options
        stops = set(self.eos_ids) | set(params.stop_token_ids)
        groups = self._prefill_groups(seqs)
        prompt_tokens = sum(len(s.prompt) for s in (seqs if every_prompt else [g[0] for g in groups]))
        needed = prompt_tokens + sum(s.max_new + o.page_size for s in seqs) + reserve
        self._ensure_cache(needed, longest, min(o.max_batch, len(seqs) + reserve // max(longest, 1)))
        max_pages = pages_for(max(longest, self.max_len), o.page_size)
        if o.record_experts and o.prefix_cache and self.stage.has_moe:  # cached pages keep their tokens' ids
            self.cache.pool.keep_experts(o.page_size, *record_layout(self.stage))
        sched = Scheduler(self.cache.pool, o.page_size, o.max_batch, o.max_num_batched_tokens, max_pages, stops,
                          prefix_cache=o.prefix_cache, mixed=o.mixed_prefill, record_experts=o.record_experts)
        for group in groups:
            sched.add_group(group)
        return sched

    def _prefill_groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """Sequences of one prompt (``prompt_index``) together, in order of first appearance, the
        request order kept within each; a group takes its slots at once, so one larger than
        ``max_batch`` is split into groups of ``max_batch`` (each prefilling the prompt once)."""
        by_prompt: dict[int, list[Sequence]] = {}
        for s in seqs:
            by_prompt.setdefault(s.prompt_index, []).append(s)
        size = self.options.max_batch
        return [g[start:start + size] for g in by_prompt.values() for start in range(0, len(g), size)]

    def _ensure_cache(self, needed_tokens: int, longest: int, max_seqs: int) -> None:
        """A KV cache for this call: sized per call, or once for max_batch x max_len when graphs hold
        its address or the prefix cache keeps pages between calls."""
        if self.graphs is not None or self.options.prefix_cache:
            needed_tokens, max_seqs = self.options.max_batch * self.max_len, self.options.max_batch
            if self.cache is not None:
                self._check_fits(self.cache.capacity, longest)
                if self.cache.storage is not None and not self.cache.storage.mapped:
                    self.cache.resume()
                self._reuse_pool(self.cache.capacity)
                return
        pages = pool_pages(self.layout, self._budget_bytes(), needed_tokens, max_seqs)
        self._check_fits(pages, longest)
        if self.cache is not None and self.cache.capacity >= pages:
            self._reuse_pool(pages)
            return
        self.cache = None
        self.cache = self._new_cache(pages)

    def _reuse_pool(self, pages: int) -> None:
        """A fresh pool, as if new, so scheduling never depends on earlier calls — unless the prefix
        cache keeps the pages of earlier calls (then the pool only grows, never shrinks)."""
        pool = self.cache.pool
        if self.options.prefix_cache and pool.num_pages >= pages:
            return
        self.cache.pool = PagePool(pages)

    def _new_cache(self, pages: int) -> KVCache:
        if self.graphs is None or self.device.type != "cuda":
            return KVCache(self.layout, pages, self.device)
        try:
            return KVCache(self.layout, pages, self.device, pinned=True)
        except (OSError, RuntimeError, AttributeError) as e:  # no CUDA VMM: keep a plain cache for good
            print(f"rollout: KV cache stays allocated between steps (CUDA virtual memory unavailable: {e})",
                  flush=True)
            return KVCache(self.layout, pages, self.device)

    def _check_fits(self, pages: int, longest: int) -> None:
        need = pages_for(longest, self.layout.page_size) + 1
        if pages < need:
            gb = need * self.layout.page_bytes() / 2**30
            raise ConfigError(f"rollout.kv_cache_gb: a KV cache of {pages} pages of {self.layout.page_size} tokens "
                              f"cannot hold one sequence of {longest} tokens; set it to at least {gb:.3g}")

    def _budget_bytes(self) -> float:
        o = self.options
        if o.kv_cache_gb > 0:
            return o.kv_cache_gb * 2**30
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return o.kv_cache_fraction * free
        import psutil

        return o.kv_cache_fraction * psutil.virtual_memory().available

    # -- running a step --------------------------------------------------------
    def _runner(self, rows: SamplingRows, longest: int) -> StepRunner:
        """How this call's steps run: eagerly, through the CUDA graphs of one stage (launched ahead when
        every sequence fits the graphs' block table), or through each pipeline stage's graphs."""
        eager = EagerRunner(self, rows)
        if self.graphs is None:
            return eager
        if self.groups.pp_size > 1:
            return PipelineGraphRunner(self, rows, eager)
        return GraphRunner(self, rows, eager, overlap=longest <= self.graphs.max_len)

    def receive_hidden(self, rows: int, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """(rows, h) hidden states from the previous pipeline stage; None on the first stage."""
        g, st = self.groups, self.stage
        if g.is_first_stage:
            return None
        x = into if into is not None else torch.empty(rows, st.hidden, dtype=st.dtype, device=self.device)
        dist.recv(x, group=g.pp, group_src=g.pp_rank - 1)
        return x

    def compute(self, batch: ForwardBatch, x: torch.Tensor | None, sample_rows: torch.Tensor | None):
        """The stage's math (TP collectives only, no p2p: what a CUDA graph captures).

        x: (T, h) from the previous stage, or None to embed ``batch.input_ids``; sample_rows: (S,)
        rows whose logits are wanted, None for every row (a decode step). Returns the (T, h) output on
        an inner stage, (S, V_padded) logits on the last (None if S = 0).
        """
        st = self.stage
        x = st.layers_forward(st.embed(batch.input_ids) if x is None else x, batch, self.cache)
        if not self.groups.is_last_stage:
            return x
        if sample_rows is None:
            return st.logits(x)
        if sample_rows.shape[0] == 0:  # a prefill chunk that completes no prompt
            return None
        return st.logits(x[sample_rows])

    def send_hidden(self, out: torch.Tensor | None) -> torch.Tensor | None:
        """Inner stages pass ``out`` on (and return None); the last stage returns its logits."""
        g = self.groups
        if g.is_last_stage:
            return out
        dist.send(out, group=g.pp, group_dst=g.pp_rank + 1)
        return None

    def share(self, sampled: torch.Tensor | None, s: int) -> tuple[np.ndarray, np.ndarray]:
        """(2, S) [tokens; log-probs] of the last stage -> numpy tokens, log-probs on every stage."""
        g = self.groups
        packed = sampled.double() if sampled is not None else torch.empty(2, s, dtype=torch.float64,
                                                                          device=self.device)
        if g.pp_size > 1:
            dist.broadcast(packed, group=g.pp, group_src=g.pp_size - 1)
        packed = packed.cpu().numpy()
        return packed[0].astype(np.int64), packed[1].astype(np.float32)

    # -- results -------------------------------------------------------------
    def _record(self, sched: Scheduler, counters: StepCounters) -> None:
        """``stats``: this call's step counters and seconds, preemptions, prefix-cache hits, memory."""
        self.stats = counters.metrics()
        self.stats.update({
            "rollout/preemptions": float(sched.preemptions),
            "rollout/prefix_cached_tokens": float(sched.reused_tokens),
            "rollout/kv_cache_gb": self.cache.nbytes / 2**30,
        })
        if self.device.type == "cuda":
            self.stats["rollout/peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30

    @staticmethod
    def _result(seq: Sequence) -> GenerationResult:
        """``seq``'s response, under its request's key (``rid``)."""
        experts, prompt_experts = sequence_expert_ids(seq)  # MoE, recorded
        return GenerationResult(seq.prompt, seq.generated, seq.logprobs, seq.finish or "length", seq.rid,
                                expert_ids=experts, prompt_expert_ids=prompt_experts)


class _Feed:
    """``serve``'s end of :class:`~megarl.rollout.engine.FollowUps`: finished sequences out (under their
    keys), requests in (each alone, its seed as is). At EP across DP (``group_step``: the engine's
    ``serve_group_step``) an idle rank waiting for follow-ups keeps taking part in the group's steps,
    so the other ranks decode on meanwhile, where the follow-ups say whether more may come
    (``pending()``); without it the rank blocks in ``poll`` and the group waits for it."""

    def __init__(self, followups: FollowUps, longest: int, group_step: Callable[[bool], bool] | None = None):
        self.followups, self.longest = followups, longest
        self.group_step = group_step if hasattr(followups, "pending") else None

    def _poll(self, idle: bool) -> list[Request]:
        if not idle or self.group_step is None:
            return self.followups.poll(idle)
        while True:
            got = self.followups.poll(False)
            if got:
                return got
            if not self.followups.pending():
                return self.followups.poll(False)  # one that came in meanwhile, or [] (the call ends)
            self.group_step(True)

    def exchange(self, sched: Scheduler, idle: bool) -> None:
        for seq in sched.take_finished():
            self.followups.finished(seq.rid, NativeEngine._result(seq))
        streamed = getattr(self.followups, "streamed", None)
        if streamed:  # requests whose tokens go out as they are recorded (the HTTP endpoint's stream=true)
            for seq in sched.running:
                if seq.rid in streamed:
                    self.followups.progress(seq.rid, seq.generated, seq.logprobs)
        for req in self._poll(idle):
            if req.max_new_tokens < 1 or len(req.prompt) + req.max_new_tokens > self.longest:
                raise ValueError(f"follow-up request {req.key}: prompt {len(req.prompt)} + max_new_tokens "
                                 f"{req.max_new_tokens} must be in [prompt + 1, {self.longest}], the longest "
                                 "initial request this call was sized for")
            alone = -1  # no prefill group: it shares nothing with the sequences already queued
            sched.add_group([Sequence(req.key, alone, list(req.prompt), req.seed, req.max_new_tokens)])

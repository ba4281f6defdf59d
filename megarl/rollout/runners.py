"""Running one planned step on the device: the one interface the engine's loop calls.

A :class:`StepRunner` takes a :class:`~megarl.rollout.scheduler.StepPlan` and
returns a :class:`StepOutput`: the step's sampled tokens and log-probs, on the
host already or still being computed. Three implementations, picked per
``generate`` call by :meth:`NativeEngine._runner`:

- :class:`EagerRunner`: the forward op by op, on any pipeline stage (hidden
  states received from the previous stage and sent to the next around it); the
  tested reference, and what every step runs on CPU;
- :class:`GraphRunner`: one stage, steps that fit a CUDA graph replay it and
  return at once, their tokens left on the device, so the loop plans the next
  step while this one runs (:meth:`StepRunner.runs_ahead`);
- :class:`PipelineGraphRunner`: pipeline-parallel, each stage replays its graph
  between receiving and sending hidden states, and the last stage broadcasts
  the tokens to its pipeline group, synchronously.

The graph runners fall back to the eager one for a step no graph fits.

Expert parallelism across DP (``stage.ep``): every step opens with the EP group's agreement on the
host (:meth:`~megarl.rollout.moe_step.EpStep.agree`): a graph step when every rank decodes within the
graphs (or is done), the group's largest bucket replayed by all; else an eager one of the agreed rows,
whose decodes and small prefills still run the graphs' buffers (uncaptured), so run-ahead works as at
EP 1. A rank that is done takes part through :meth:`NativeEngine.serve_group_until_done`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from megarl.rollout.engine import SamplingParams
from megarl_kernels.sampling import sample_tokens
from megarl.rollout.graphs import Launched
from megarl.rollout.prefill_graphs import MAX_TOKENS as PREFILL_GRAPH_TOKENS
from megarl.rollout.scheduler import StepPlan
from megarl.rollout.stage import ForwardBatch, prefill_cu
from megarl.rollout.step_experts import StepExperts, small_ids


@dataclass
class StepOutput:
    """What running a step gives: its (S,) tokens and log-probs, now or once the device is done."""

    via_graph: bool = False  # replayed through a CUDA graph (counted as a graph step)
    launched: Launched | None = None  # in flight: ``result()`` waits for its copy to the host
    tokens: np.ndarray | None = None  # (S,) int64 of a step that ran synchronously
    logprobs: np.ndarray | None = None  # (S,) float32
    row_base: int = 0  # in flight: sampled row r's token stays in the device output row row_base + r
    experts: StepExperts | None = None  # in flight, recording experts: where its ids go once they are here

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(S,) tokens and log-probs on the host (waits for a step in flight, and files its expert ids)."""
        if self.launched is None:
            return self.tokens, self.logprobs
        out = self.launched.result()
        if self.experts is not None:
            self.experts.record(self.launched.expert_rows)
            self.experts = None
        return out


class SamplingRows:
    """Per-row sampling settings of one generate call (every request shares ``params``)."""

    def __init__(self, params: SamplingParams, device, rows: int = 256):
        self.params, self.device = params, device
        self._fill(rows)

    def _fill(self, rows: int) -> None:
        p, dev = self.params, self.device
        self.temperature = torch.full((rows,), float(p.temperature), device=dev)
        self.top_k = torch.full((rows,), int(p.top_k), dtype=torch.int32, device=dev)
        self.top_p = torch.full((rows,), float(p.top_p), device=dev)

    def grow(self, rows: int) -> "SamplingRows":
        if rows > self.temperature.shape[0]:
            self._fill(rows)
        return self


class StepRunner(ABC):
    """Runs the planned steps of one generate call (its sampling settings: ``rows``)."""

    # a refill planned ahead of a step in flight is held to this many new tokens (None: never planned ahead)
    ahead_tokens: int | None = None

    def __init__(self, engine, rows: SamplingRows):
        self.engine, self.rows = engine, rows

    def runs_ahead(self, plan: StepPlan) -> bool:
        """Does ``plan`` run while the host goes on, its tokens left on the device for the next step?"""
        return False

    def run(self, plan: StepPlan) -> StepOutput:
        """The step's copy-on-write page copies, then its forward and sampling."""
        if plan.copies[0]:
            self.engine.cache.copy_pages(*plan.copies)
        return self.execute(plan)

    def experts_of(self, plan: StepPlan) -> StepExperts | None:
        """Where ``plan``'s expert ids go when the engine records them (an MoE stage), else None."""
        engine = self.engine
        if not (engine.options.record_experts and engine.stage.has_moe):
            return None
        return StepExperts(plan, engine.cache.pool.experts)

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepOutput:
        """The forward and sampling of ``plan`` (its pages already copied)."""


class EagerRunner(StepRunner):
    """The step op by op; with PP, hidden states from the previous stage in, to the next out."""

    def execute(self, plan: StepPlan) -> StepOutput:
        engine = self.engine
        if engine.stage.ep is not None:  # EP across DP: an eager step of the group's rows
            engine.stage.ep.agree(len(plan.input_ids))
        batch = self.to_device(plan)
        sample_rows = torch.as_tensor(plan.sample_rows, device=engine.device)  # (S,)
        x = engine.receive_hidden(batch.input_ids.shape[0])  # (T, h) from the previous stage, or None
        experts = self.experts_of(plan)
        engine.stage.moe_ids = [] if experts is not None else None
        logits = engine.send_hidden(engine.compute(batch, x, sample_rows))  # (S, V_padded) on the last stage
        if experts is not None:
            experts.record(small_ids(engine.stage.moe_ids, engine.stage.num_experts).cpu().numpy())
            engine.stage.moe_ids = None
        tokens, logprobs = self._sample_and_share(logits, plan)
        return StepOutput(tokens=tokens, logprobs=logprobs)

    def to_device(self, plan: StepPlan) -> ForwardBatch:
        dev, max_len = self.engine.device, self.engine.max_len

        def put(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype, non_blocking=True)

        q_lens = np.diff(plan.cu_seqlens_q)
        return ForwardBatch(
            put(plan.input_ids, torch.long), put(plan.positions, torch.long), put(plan.slot_mapping, torch.long),
            put(plan.block_table, torch.int32), put(plan.seq_lens, torch.int32),
            put(plan.cu_seqlens_q, torch.int32), int(q_lens.max()), plan.decode, max_len,
            plan.decoding, plan.decoding,
            put(prefill_cu(plan.cu_seqlens_q, plan.decoding), torch.int32) if plan.decoding else None,
        )

    def _sample_and_share(self, logits, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """The last stage samples; its pipeline group receives tokens and log-probs (numpy, (S,))."""
        engine, s = self.engine, len(plan.sampled)
        if s == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        packed = None
        if engine.groups.is_last_stage:
            seeds = torch.as_tensor(plan.seeds, device=engine.device)
            offsets = torch.as_tensor(plan.offsets, device=engine.device)
            rows = self.rows.grow(s)
            packed = torch.stack(sample_tokens(logits, rows.temperature[:s], rows.top_k[:s], rows.top_p[:s], seeds,
                                               offsets, vocab_size=engine.vocab_size))
        return engine.share(packed, s)


class GraphRunner(StepRunner):
    """One stage: decode steps and small prefills replay a CUDA graph and return at once; with
    ``overlap`` (every sequence fits the graphs' block table) the loop launches them ahead."""

    ahead_tokens = PREFILL_GRAPH_TOKENS

    def __init__(self, engine, rows: SamplingRows, eager: EagerRunner, overlap: bool):
        super().__init__(engine, rows)
        self.eager, self.overlap = eager, overlap

    def _graphs(self, plan: StepPlan):
        """The decode or prefill graphs ``plan`` fits; None: it runs eagerly."""
        graphs = self.engine.graphs if plan.decode else self.engine.prefill_graphs
        return graphs if graphs.fits(plan) else None

    def runs_ahead(self, plan: StepPlan) -> bool:
        return self.overlap and self._graphs(plan) is not None

    def _agree(self, plan: StepPlan, graphs):
        """EP across DP: the group's :class:`~megarl.rollout.moe_step.StepShape` of ``plan``, whose forward
        has its graph's rows (a decode can take a graph step, a prefill cannot); None without EP."""
        ep = self.engine.stage.ep
        return None if ep is None else ep.agree(graphs.bucket(plan), graph_ok=plan.decode)

    def execute(self, plan: StepPlan) -> StepOutput:
        graphs = self._graphs(plan)
        if graphs is None:
            return self.eager.execute(plan)
        base = 0 if plan.decode else self.engine.graphs.prefill_rows_base
        experts = self.experts_of(plan)  # before the loop advances the plan
        shape = self._agree(plan, graphs)
        return StepOutput(via_graph=shape is None or shape.graph, launched=graphs.launch(plan, self.rows, shape),
                          row_base=base, experts=experts)


class PipelineGraphRunner(GraphRunner):
    """Pipeline-parallel: the stage's graph between the p2p of hidden states, tokens broadcast from the
    last stage; synchronous (a stage cannot run ahead of its neighbours)."""

    ahead_tokens = None

    def __init__(self, engine, rows: SamplingRows, eager: EagerRunner):
        super().__init__(engine, rows, eager, overlap=False)

    def execute(self, plan: StepPlan) -> StepOutput:
        graphs = self._graphs(plan)
        if graphs is None:
            return self.eager.execute(plan)
        experts = self.experts_of(plan)
        shape = self._agree(plan, graphs)
        tokens, logprobs = graphs.run_between_stages(plan, self.rows, shape)
        if experts is not None:
            experts.record(graphs.expert_ids.read(len(plan.input_ids)))
        return StepOutput(via_graph=shape is None or shape.graph, tokens=tokens, logprobs=logprobs)

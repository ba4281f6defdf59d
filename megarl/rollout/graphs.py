"""CUDA graphs of the decode step (all layers, logits, sampling) at bucketed batch sizes.

A bucket's graph is captured the first time a decode step of that size (or
the next smaller batch) runs, and replayed from then on — across PPO steps:
the graph reads the actor's parameters through their addresses, and the
optimizer updates those tensors in place (megatron's DDP buffers and the
distributed optimizer never re-allocate them), so new weights need no new
capture. :meth:`DecodeGraphs.check_weights` asserts that at every weight sync
by comparing the pointers seen at capture. TP all-reduces and the logits
all-gather run inside the graph; with PP each stage replays its own graph
between receiving and sending hidden states (point-to-point stays outside),
and the last stage's tokens are broadcast to the pipeline group.

Inputs live in two static buffers, (6, B) int64 rows (ids, positions, cache
rows, lengths, seeds, token indices) and the (B, max_pages) block table: each
replay fills their host copies and moves each with one copy; rows past the
real batch read nothing (0 keys) and write their K/V to the scratch page. ``capture=False`` runs the very same
buffers and padding eagerly (CPU tests of this path).
"""
from __future__ import annotations

import numpy as np
import torch

from megarl.kernels.sampling import sample_tokens
from megarl.rollout.pages import pages_for
from megarl.rollout.stage import ForwardBatch

# Batch sizes with a graph: padding a batch up to its bucket costs at most ~1/3 extra rows,
# and decode time is dominated by reading the weights, not by the rows.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
_ROW_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "seeds", "offsets")  # (B,) each


def buckets_up_to(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    """Lazily captured decode graphs of one engine, sharing one memory pool."""

    def __init__(self, engine, max_batch: int, capture: bool = True):
        self.engine, self.max_batch, self.capture = engine, max_batch, capture
        self.buckets = buckets_up_to(max_batch)
        self.max_pages = pages_for(engine.max_len, engine.options.page_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.pointers: list[int] = []
        self.rows_seen = None  # the sampling settings now in the static buffers
        b, dev = max_batch, engine.device
        self.host = np.zeros((len(_ROW_FIELDS), b), dtype=np.int64)  # one contiguous (B,) row per field
        self.host_table = np.zeros((b, self.max_pages), dtype=np.int32)
        self.inputs = torch.zeros(self.host.shape, dtype=torch.long, device=dev)
        self.table = torch.zeros(self.host_table.shape, dtype=torch.int32, device=dev)
        self.temperature = torch.ones(b, device=dev)
        self.top_k = torch.full((b,), -1, dtype=torch.int32, device=dev)
        self.top_p = torch.ones(b, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.sampled = torch.zeros(2, b, device=dev)  # [tokens; log-probs] of the last stage
        stage = engine.stage  # with PP: hidden states in from the previous stage, out to the next
        self.hidden_in = torch.zeros(b, stage.hidden, dtype=stage.dtype, device=dev)
        self.hidden_out = torch.zeros_like(self.hidden_in)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, plan) -> bool:
        return len(plan.seqs) <= self.max_batch and plan.block_table.shape[1] <= self.max_pages

    # -- the step ------------------------------------------------------------
    def _field(self, name: str, b: int) -> torch.Tensor:
        return self.inputs[_ROW_FIELDS.index(name), :b]

    def _body(self, b: int) -> None:
        """The decode step of this stage on the first ``b`` rows of the static buffers."""
        f = lambda name: self._field(name, b)  # noqa: E731
        batch = ForwardBatch(f("input_ids"), f("positions"), f("slot_mapping"), self.table[:b], f("seq_lens"),
                             self.cu[: b + 1], 1, True)
        engine = self.engine
        x = None if engine.groups.is_first_stage else self.hidden_in[:b]
        out = engine.compute(batch, x, self.rows[:b])
        if not engine.groups.is_last_stage:
            self.hidden_out[:b].copy_(out)
            return
        tokens, logprobs = sample_tokens(out, self.temperature[:b], self.top_k[:b], self.top_p[:b],
                                         f("seeds"), f("offsets"), vocab_size=engine.vocab_size)
        self.sampled[0, :b].copy_(tokens)
        self.sampled[1, :b].copy_(logprobs)

    def _capture(self, b: int) -> torch.cuda.CUDAGraph:
        self.inputs.zero_()  # warm-up writes land in the scratch page
        self.table.zero_()
        self.hidden_in.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile / autotune / allocate outside the capture
                self._body(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._body(b)
        self.pool = graph.pool()
        self.pointers = self.pointers or self._weight_pointers()
        return graph

    def run(self, plan, rows) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and log-probs (n,) of a decode step, through the bucket's graph."""
        engine, n = self.engine, len(plan.seqs)
        b = next(x for x in self.buckets if x >= n)
        if self.capture and b not in self.graphs:
            self.graphs[b] = self._capture(b)
        self._load(plan, rows, b)
        if engine.receive_hidden(n, into=self.hidden_in[:n]) is not None:
            self.hidden_in[n:b].zero_()
        if self.capture:
            self.graphs[b].replay()
        else:
            self._body(b)
        engine.send_hidden(None if engine.groups.is_last_stage else self.hidden_out[:n])
        return engine.share(self.sampled[:, :n] if engine.groups.is_last_stage else None, n)

    def _load(self, plan, rows, b: int) -> None:
        """The step's inputs into the static buffers (padded rows zero): two host fills, two copies."""
        n, width = len(plan.seqs), plan.block_table.shape[1]
        self.host[:, n:b] = 0
        for i, name in enumerate(_ROW_FIELDS):
            self.host[i, :n] = getattr(plan, name)
        self.host_table[:b] = 0
        self.host_table[:n, :width] = plan.block_table
        self.inputs.copy_(torch.from_numpy(self.host))
        self.table[:b].copy_(torch.from_numpy(self.host_table[:b]))
        if rows is not self.rows_seen:  # the sampling settings change per generate call, not per step
            rows = rows.grow(self.max_batch)
            for name in ("temperature", "top_k", "top_p"):
                getattr(self, name).copy_(getattr(rows, name)[: self.max_batch])
            self.rows_seen = rows

    # -- weights -------------------------------------------------------------
    def _weight_pointers(self) -> list[int]:
        return [t.data_ptr() for t in self.engine.stage.parameters()]

    def check_weights(self) -> None:
        """The captured graphs read the parameters by address: they must not have moved."""
        if self.pointers and self._weight_pointers() != self.pointers:
            raise RuntimeError("actor parameters were re-allocated after the decode CUDA graphs were captured; "
                               "the graphs would read stale weights (set rollout.cuda_graphs=false)")

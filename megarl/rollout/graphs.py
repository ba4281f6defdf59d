"""CUDA graphs of the decode step (all layers, logits, sampling) at bucketed batch sizes.

A bucket's graph is captured the first time a decode step of that size (or
the next smaller batch) runs, and replayed from then on — across PPO steps:
the graph reads the actor's parameters through their addresses, and the
optimizer updates those tensors in place (megatron's DDP buffers and the
distributed optimizer never re-allocate them), so new weights need no new
capture. :meth:`DecodeGraphs.check_weights` asserts that at every weight sync
by comparing the pointers seen at capture. TP all-reduces and the logits
all-gather run inside the graph.

Inputs live in static buffers: each replay copies the step's ids, positions,
cache rows, block table, lengths, seeds and token indices in; rows past the
real batch read nothing (0 keys) and write their K/V to the scratch page.
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


def buckets_up_to(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    """Lazily captured decode graphs of one engine, sharing one memory pool."""

    def __init__(self, engine, max_batch: int):
        self.engine, self.max_batch = engine, max_batch
        self.buckets = buckets_up_to(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.static = None
        self.pointers: list[int] = []

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, plan) -> bool:
        page = self.engine.options.page_size
        return len(plan.seqs) <= self.max_batch and plan.block_table.shape[1] * page <= self._max_tokens()

    def _max_tokens(self) -> int:
        return pages_for(self.engine.max_len, self.engine.options.page_size) * self.engine.options.page_size

    # -- capture -------------------------------------------------------------
    def _buffers(self, max_pages: int) -> dict:
        b, dev = self.max_batch, self.engine.device
        return {
            "input_ids": torch.zeros(b, dtype=torch.long, device=dev),
            "positions": torch.zeros(b, dtype=torch.long, device=dev),
            "slot_mapping": torch.zeros(b, dtype=torch.long, device=dev),
            "block_table": torch.zeros(b, max_pages, dtype=torch.int32, device=dev),
            "seq_lens": torch.zeros(b, dtype=torch.int32, device=dev),
            "cu_seqlens_q": torch.arange(b + 1, dtype=torch.int32, device=dev),
            "rows": torch.arange(b, dtype=torch.long, device=dev),
            "seeds": torch.zeros(b, dtype=torch.long, device=dev),
            "offsets": torch.zeros(b, dtype=torch.long, device=dev),
            "temperature": torch.ones(b, device=dev),
            "top_k": torch.full((b,), -1, dtype=torch.int32, device=dev),
            "top_p": torch.ones(b, device=dev),
            "tokens": torch.zeros(b, dtype=torch.long, device=dev),
            "logprobs": torch.zeros(b, device=dev),
        }

    def _body(self, b: int) -> None:
        """The decode step on the first ``b`` rows of the static buffers."""
        s = self.static
        batch = ForwardBatch(s["input_ids"][:b], s["positions"][:b], s["slot_mapping"][:b],
                             s["block_table"][:b], s["seq_lens"][:b], s["cu_seqlens_q"][: b + 1], 1, True)
        logits = self.engine._forward(batch, s["rows"][:b])
        tokens, logprobs = sample_tokens(logits, s["temperature"][:b], s["top_k"][:b], s["top_p"][:b],
                                         s["seeds"][:b], s["offsets"][:b], vocab_size=self.engine.vocab_size)
        s["tokens"][:b].copy_(tokens)
        s["logprobs"][:b].copy_(logprobs)

    def _capture(self, b: int) -> torch.cuda.CUDAGraph:
        if self.static is None:
            self.static = self._buffers(self._max_tokens() // self.engine.options.page_size)
        self._reset_inputs()  # warm-up writes land in the scratch page
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

    def _reset_inputs(self) -> None:
        s = self.static
        for key in ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens", "seeds", "offsets"):
            s[key].zero_()

    def _weight_pointers(self) -> list[int]:
        return [t.data_ptr() for t in self.engine.stage.parameters()]

    def check_weights(self) -> None:
        """The captured graphs read the parameters by address: they must not have moved."""
        if self.pointers and self._weight_pointers() != self.pointers:
            raise RuntimeError("actor parameters were re-allocated after the decode CUDA graphs were captured; "
                               "the graphs would read stale weights (set rollout.cuda_graphs=false)")

    def drop(self) -> None:
        """Forget every graph (the KV cache they point at is being replaced)."""
        self.graphs.clear()

    # -- replay --------------------------------------------------------------
    def run(self, plan, rows) -> tuple[np.ndarray, np.ndarray]:
        n = len(plan.seqs)
        b = next(x for x in self.buckets if x >= n)
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        s = self.static
        self._reset_inputs()
        width = plan.block_table.shape[1]
        for key, value in (("input_ids", plan.input_ids), ("positions", plan.positions),
                           ("slot_mapping", plan.slot_mapping), ("seq_lens", plan.seq_lens),
                           ("seeds", plan.seeds), ("offsets", plan.offsets)):
            s[key][:n].copy_(torch.from_numpy(np.ascontiguousarray(value)), non_blocking=True)
        s["block_table"][:n, :width].copy_(torch.from_numpy(plan.block_table), non_blocking=True)
        rows = rows.grow(n)
        for key in ("temperature", "top_k", "top_p"):
            s[key][:n].copy_(getattr(rows, key)[:n])
        self.graphs[b].replay()
        return s["tokens"][:n].cpu().numpy(), s["logprobs"][:n].cpu().numpy()

"""CUDA graphs of the decode step (all layers, logits, sampling) at bucketed batch sizes.

A bucket's graph is captured the first time a decode step of that size (or
the next smaller batch) runs, and replayed from then on — across PPO steps:
the graph reads the actor's parameters through their addresses, and the
optimizer updates those tensors in place (megatron's DDP buffers and the
distributed optimizer never re-allocate them), so new weights need no new
capture. :meth:`GraphShared.check_weights` asserts that at every weight sync
by comparing the pointers seen at capture. TP all-reduces and the logits
all-gather run inside the graph; with PP each stage replays its own graph
between receiving and sending hidden states (point-to-point stays outside),
and the last stage's tokens are broadcast to the pipeline group.

Inputs live in two static buffers, (7, B) int64 rows (ids, positions, cache
rows, lengths, seeds, token indices, source rows) and the (B, max_pages) block
table: each replay fills their pinned host copies (two sets, used in turn) and
one kernel reads both over the bus into the device buffers (`copy_words`: no
copy engine between the graphs, as the tokens going out); rows past the real batch read nothing
(0 keys) and write their K/V to the scratch page. A row whose token is still
on the device (planned ahead, see ``scheduler.py``) takes it inside the graph
from ``outputs[src_rows]``: one flat buffer holding the last decode replay's
[tokens; log-probs] and, after them (from ``prefill_rows_base``), the last
prefill graph's, so a refill planned ahead feeds the next decode as directly.
:meth:`DecodeGraphs.launch` returns at once; the tokens come back through a
pinned buffer and an event, so the host plans the next step while this one runs. ``capture=False`` runs the
very same buffers and padding eagerly (CPU tests of this path). What every graph
of an engine shares — the memory pool, the weight pointers, the per-row sampling
settings — is :class:`GraphShared`, which the prefill graphs
(``prefill_graphs.py``) use too.

Expert parallelism across DP (megarl/rollout/moe_step.py): the EP group's ranks agree on each step on
the host; a decode step that every rank can take as a graph replays, on every rank, the graph of the
group's largest bucket (``launch``'s ``ep``), and a rank that is done replays it with padding only
(:meth:`DecodeGraphs.idle`); so every rank captures the same buckets at the same steps. Otherwise the
step runs this body uncaptured at its own bucket. The captured path at EP is unverified on a GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from megarl_kernels.feed_tokens import feed_tokens
from megarl_kernels.host_copy import copy_words
from megarl_kernels.sampling import sample_tokens
from megarl.rollout.pages import pages_for
from megarl.rollout.stage import ForwardBatch
from megarl.rollout.step_experts import GraphIds

# Batch sizes with a graph: padding a batch up to its bucket costs at most ~1/3 extra rows,
# and decode time is dominated by reading the weights, not by the rows.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
_ROW_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "seeds", "offsets", "src_rows")  # (B,) each
_SRC = _ROW_FIELDS.index("src_rows")


def buckets_up_to(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


def host_buffer(shape, dtype, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, pinned when ``pin`` (asynchronous copies to or from the device)."""
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if pin else t


class Launched:
    """A step in flight: its (2, n) [tokens; log-probs] land in a host buffer (and, where the engine
    records experts, its (T, layers, k) expert ids in ``expert_rows``)."""

    def __init__(self, out: torch.Tensor, done, expert_rows: np.ndarray | None = None):
        self.out, self.done, self.expert_rows = out, done, expert_rows

    @classmethod
    def copy_out(cls, sampled: torch.Tensor, host: torch.Tensor, n: int, ids: GraphIds | None = None,
                 id_rows: int = 0) -> "Launched":
        """Queues the copy of the whole (2, W) ``sampled`` buffer into the pinned ``host`` buffer of
        2 W elements (one kernel, `copy_words`, with the first ``id_rows`` rows of ``ids``); its first
        n columns are the step's."""
        pairs, expert_rows = [(host, sampled.view(-1))], None
        if ids is not None:
            pair, expert_rows = ids.copy_pair(id_rows)
            pairs.append(pair)
        copy_words(pairs)
        done = torch.cuda.Event() if sampled.is_cuda else None
        if done is not None:
            done.record()
        return cls(host.view(2, -1)[:, :n], done, expert_rows)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self.done is not None:
            self.done.synchronize()
        out = self.out.numpy()
        return out[0].astype(np.int64), out[1].copy()


class GraphShared:
    """What every captured graph of one engine shares: one memory pool (replays never overlap, and
    a graph's temporaries are dead once it ends, so any replay order is safe), the addresses of the
    weights they read, and the per-row sampling settings (static, ``max_batch`` rows)."""

    def __init__(self, engine, max_batch: int):
        self.engine, self.pool, self.pointers = engine, None, []
        dev = engine.device
        self.temperature = torch.ones(max_batch, device=dev)
        self.top_k = torch.full((max_batch,), -1, dtype=torch.int32, device=dev)
        self.top_p = torch.ones(max_batch, device=dev)
        self.rows_seen = None  # the sampling settings now in the static buffers

    def capture(self, body) -> torch.cuda.CUDAGraph:
        """``body()`` run twice on a side stream (compile, autotune, allocate), then captured."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        self.pool = graph.pool()
        self.pointers = self.pointers or self._weight_pointers()
        return graph

    def load_sampling(self, rows) -> None:
        """The call's sampling settings into the static rows (they change per generate call, not per step)."""
        if rows is self.rows_seen:
            return
        rows = rows.grow(self.temperature.shape[0])
        for name in ("temperature", "top_k", "top_p"):
            getattr(self, name).copy_(getattr(rows, name)[: self.temperature.shape[0]])
        self.rows_seen = rows

    def sample(self, logits: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor) -> None:
        """(S, V) logits -> [tokens; log-probs] into ``out`` (2, S) fp32, under the static sampling rows."""
        s = logits.shape[0]
        sample_tokens(logits, self.temperature[:s], self.top_k[:s], self.top_p[:s], seeds, offsets,
                      vocab_size=self.engine.vocab_size, out=out)

    def _weight_pointers(self) -> list[int]:
        return [t.data_ptr() for t in self.engine.stage.parameters()]

    def check_weights(self) -> None:
        """The captured graphs read the parameters by address: they must not have moved."""
        if self.pointers and self._weight_pointers() != self.pointers:
            raise RuntimeError("actor parameters were re-allocated after the rollout CUDA graphs were captured; "
                               "the graphs would read stale weights (set rollout.cuda_graphs=false)")


class DecodeGraphs:
    """Lazily captured decode graphs of one engine, sharing one memory pool."""

    def __init__(self, engine, max_batch: int, capture: bool = True):
        self.engine, self.max_batch, self.capture = engine, max_batch, capture
        self.shared = GraphShared(engine, max_batch)
        self.buckets = buckets_up_to(max_batch)
        self.max_len = engine.max_len  # longest sequence the static block table holds
        self.max_pages = pages_for(engine.max_len, engine.options.page_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        b, dev = max_batch, engine.device
        pin = dev.type == "cuda"  # host buffers the copies read (or write) while the host goes on
        self.staging = [(host_buffer((len(_ROW_FIELDS), b), torch.long, pin),
                         host_buffer((b, self.max_pages), torch.int32, pin),
                         host_buffer((2 * b,), torch.float32, pin)) for _ in range(2)]
        self.turn = 0
        self.inputs = torch.zeros((len(_ROW_FIELDS), b), dtype=torch.long, device=dev)
        self.table = torch.zeros((b, self.max_pages), dtype=torch.int32, device=dev)
        self.cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.outputs = torch.zeros(4 * b, device=dev)  # decode's (2, b) [tokens; log-probs], then prefill's
        self.sampled = self.outputs[: 2 * b].view(2, b)  # of the last stage
        self.prefill_sampled = self.outputs[2 * b:].view(2, b)  # PrefillGraphs writes its rows here
        self.prefill_rows_base = 2 * b  # prefill row r's token is outputs[prefill_rows_base + r]
        stage = engine.stage  # with PP: hidden states in from the previous stage, out to the next
        self.hidden_in = torch.zeros(b, stage.hidden, dtype=stage.dtype, device=dev)
        self.hidden_out = torch.zeros_like(self.hidden_in)
        self.expert_ids = GraphIds.of(engine, b)  # rollout.record_experts: each row's ids, per MoE layer
        self.idle_done = None  # CUDA: the event after the last idle step (EP across DP), until a real one

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
        src = f("src_rows")  # tokens still on the device: rows of the step that sampled them
        ids = feed_tokens(src, self.outputs, f("input_ids"))
        batch = ForwardBatch(ids, f("positions"), f("slot_mapping"), self.table[:b], f("seq_lens"),
                             self.cu[: b + 1], 1, True, self.engine.max_len)
        engine = self.engine
        x = None if engine.groups.is_first_stage else self.hidden_in[:b]
        forward = lambda: engine.compute(batch, x, None)  # noqa: E731 (every row samples)
        out = forward() if self.expert_ids is None else self.expert_ids.compute(engine.stage, b, forward)
        if not engine.groups.is_last_stage:
            self.hidden_out[:b].copy_(out)
            return
        self.shared.sample(out, f("seeds"), f("offsets"), self.sampled[:, :b])

    def _capture(self, b: int) -> torch.cuda.CUDAGraph:
        self.inputs.zero_()  # warm-up writes land in the scratch page
        self.table.zero_()
        self.hidden_in.zero_()
        return self.shared.capture(lambda: self._body(b))

    def bucket(self, plan) -> int:
        """The rows of ``plan``'s graph: the smallest bucket that holds its batch."""
        return next(x for x in self.buckets if x >= len(plan.seqs))

    def run_between_stages(self, plan, rows, ep=None) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and log-probs (n,) of a decode step under PP, on every stage: hidden states in from the
        previous stage, the bucket's graph, hidden states out to the next, tokens from the last."""
        engine, n = self.engine, len(plan.seqs)
        b, replay = self._prepare(plan, rows, ep)
        if engine.receive_hidden(n, into=self.hidden_in[:n]) is not None:
            self.hidden_in[n:b].zero_()
        self._replay(b, replay)
        engine.send_hidden(None if engine.groups.is_last_stage else self.hidden_out[:n])
        return engine.share(self.sampled[:, :n] if engine.groups.is_last_stage else None, n)

    def launch(self, plan, rows, ep=None) -> "Launched":
        """Starts a decode step (one stage, no PP) and returns at once; ``.result()`` waits. ``ep``: the
        EP group's agreed :class:`~megarl.rollout.moe_step.StepShape` (EP across DP), else None."""
        n = len(plan.seqs)
        self._replay(*self._prepare(plan, rows, ep))
        return Launched.copy_out(self.sampled, self.staging[self.turn][2], n, self.expert_ids, n)

    def idle(self, b: int) -> None:
        """EP across DP, this rank idle (done, or waiting for follow-ups): the agreed bucket's graph with
        every row padding (its experts serve the other ranks' rows; its outputs are not read). Idle
        steps are not waited for: each fills the whole staging set, so a copy still queued reads
        padding whatever its bucket, and the next real step's ``_load`` first waits for the last one
        (its inputs go into a staging set that a queued idle copy may still read)."""
        self._ensure(b)
        self.turn ^= 1
        host, host_table, _ = (t.numpy() for t in self.staging[self.turn])
        host[:] = 0
        host[_SRC] = -1
        host_table[:] = 0
        copy_words([(self.inputs, self.staging[self.turn][0]), (self.table[:b], self.staging[self.turn][1][:b])])
        self._replay(b, True)
        if self.inputs.is_cuda:
            self.idle_done = torch.cuda.Event()
            self.idle_done.record()

    def _prepare(self, plan, rows, ep=None) -> tuple[int, bool]:
        """Captures the bucket's graph if new, loads the inputs; returns the bucket size and whether its
        graph replays. At EP across DP (``ep``) the bucket is the group's on a graph step; on an eager
        one the step runs the body uncaptured at its own bucket (the exchange padded to ``ep.rows``)."""
        replay = ep is None or ep.graph
        b = ep.rows if ep is not None and ep.graph else self.bucket(plan)
        if b not in self.buckets:
            raise RuntimeError(f"the EP group agreed on a decode graph of {b} rows, which is not a bucket of "
                               f"rollout.max_batch={self.max_batch} here: every rank must set the same max_batch")
        if replay:
            self._ensure(b)
        self._load(plan, rows, b)
        return b, replay

    def _ensure(self, b: int) -> None:
        if self.capture and b not in self.graphs:
            self.graphs[b] = self._capture(b)

    def _replay(self, b: int, replay: bool) -> None:
        if self.capture and replay:
            self.graphs[b].replay()
        else:
            self._body(b)

    def _load(self, plan, rows, b: int) -> None:
        """The step's inputs into the static buffers (padded rows zero): two host fills, two copies."""
        n, width = len(plan.seqs), plan.block_table.shape[1]
        if self.idle_done is not None:  # idle steps ran since the last real one: their copies are done
            self.idle_done.synchronize()
            self.idle_done = None
        self.turn ^= 1  # the other set's copies may still be queued
        host, host_table, _ = (t.numpy() for t in self.staging[self.turn])
        host[:, n:b] = 0
        for i, name in enumerate(_ROW_FIELDS[:_SRC]):
            host[i, :n] = getattr(plan, name)
        host[_SRC, :n] = plan.src_rows if plan.src_rows is not None else -1
        host[_SRC, n:b] = -1
        host_table[:b] = 0
        host_table[:n, :width] = plan.block_table
        copy_words([(self.inputs, self.staging[self.turn][0]), (self.table[:b], self.staging[self.turn][1][:b])])
        self.shared.load_sampling(rows)

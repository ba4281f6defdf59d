"""CUDA graphs of small prefill steps, bucketed by new tokens and by sequences.

A prefill of a few prompts (a continuous-batching refill, a multi-turn follow-up)
is host-bound when run eagerly: ~10 launches per layer, each costing more host
time than its kernel takes on the device. Such a step replays a graph captured
at a bucket (t, c) instead:
its T new tokens, N sequences and S sampled rows are padded to t >= T tokens and
c >= max(N, S) rows:

- tokens past T sit at position 0, write their K/V to the scratch page and belong
  to no sequence (the attention leaves their rows unspecified; every other op is
  row-wise, so they touch no real row);
- sequences past N have no queries and no keys;
- sampled rows past S read token 0, and their tokens are dropped.

A mixed step's decode rows (``StepPlan.decoding``: one-query sequences with their history)
go through the decode kernel, in a graph keyed by their row bucket too (rows of that bucket
past the real ones are prompt tokens: the prefill kernel's output is kept there); where
such a row's token is still pending on the device (``src_rows``), the graph reads it
from the decode graphs' outputs, as a decode replay does.

The paged prefill kernel's grid is sized for t queries per sequence (its blocks
past a sequence's queries exit at once). Prefills over ``MAX_TOKENS`` are
device-bound and stay eager. The weights, the memory pool and the per-row
sampling settings are the decode graphs' (:class:`~megarl.rollout.graphs.GraphShared`),
and the sampled tokens land in the decode graphs' output buffer, after the decode
rows, so a decode planned behind a prefill still in flight reads them on the device
(:meth:`PrefillGraphs.launch`). With PP each stage replays between receiving and
sending hidden states, as decode does. ``capture=False`` runs the same padded
buffers eagerly (CPU tests). At EP across DP a prefill step is never captured (its key differs per
rank, and the group's ranks must capture together: megarl/rollout/moe_step.py): it runs the same
padded buffers eagerly, its exchange padded to the group's agreed rows, its tokens left on the device.
"""
from __future__ import annotations

import numpy as np
import torch

from megarl_kernels.feed_tokens import feed_tokens
from megarl_kernels.host_copy import copy_words
from megarl.rollout.graphs import Launched, buckets_up_to, host_buffer
from megarl.rollout.stage import ForwardBatch, prefill_cu
from megarl.rollout.step_experts import GraphIds

# Token buckets. Graphs cover prefills up to 2048 tokens (refills and follow-ups: run eagerly, their
# wall time was a multiple of their kernel time); a larger prefill runs eagerly, its launches small
# beside its kernels (docs/performance.md). The cap moves host time only: the tokens are the same.
# Mixed steps add a decode row per running sequence (128 slots + 4 refills of 128 tokens: 640), so
# from 128 up a bucket pads by at most a third, as the decode buckets do.
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
MAX_TOKENS = TOKEN_BUCKETS[-1]
_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "src_rows")  # (t,) each
_ROW_FIELDS = ("seq_lens", "cu_seqlens_q", "sample_rows", "seeds", "offsets", "cu_prefill")  # (c,), cu's (c + 1,)


class PrefillGraphs:
    """Lazily captured prefill graphs of one engine, beside its decode graphs."""

    def __init__(self, engine, decode, capture: bool = True):
        self.engine, self.shared, self.capture = engine, decode.shared, capture
        self.max_rows, self.max_pages = decode.max_batch, decode.max_pages
        self.row_buckets = buckets_up_to(decode.max_batch)
        self.graphs: dict[tuple[int, int, int, int], torch.cuda.CUDAGraph] = {}  # (tokens, rows, decode rows
        #                                                                           up to, prefill rows from)
        dev, pin = engine.device, engine.device.type == "cuda"
        t, c = MAX_TOKENS, self.max_rows
        self.host = [host_buffer(shape, dtype, pin) for shape, dtype in (
            ((len(_TOKEN_FIELDS), t), torch.long), ((len(_ROW_FIELDS), c + 1), torch.long),
            ((c, self.max_pages), torch.int32))]
        self.tokens, self.rows, self.table = (torch.zeros_like(h, device=dev) for h in self.host)
        self.sampled = decode.prefill_sampled  # (2, c) [tokens; log-probs] of the last stage
        self.outputs = decode.outputs  # a mixed step's pending tokens: rows of the last decode
        # tokens of two prefills, in turn: one may be launched while the last is still unrecorded
        self.out = [host_buffer((2 * c,), torch.float32, pin) for _ in range(2)]
        self.turn = 0
        self.copied = torch.cuda.Event() if pin else None  # the host buffers are free again
        stage = engine.stage
        self.hidden_in = torch.zeros(t, stage.hidden, dtype=stage.dtype, device=dev)
        self.hidden_out = torch.zeros_like(self.hidden_in)
        self.expert_ids = GraphIds.of(engine, t)  # rollout.record_experts: each token's ids, per MoE layer

    def fits(self, plan) -> bool:
        return (len(plan.input_ids) <= MAX_TOKENS and max(len(plan.seqs), len(plan.sampled)) <= self.max_rows
                and plan.block_table.shape[1] <= self.max_pages)

    def bucket(self, plan) -> int:
        """The tokens of ``plan``'s graph: the smallest token bucket that holds them."""
        return next(b for b in TOKEN_BUCKETS if b >= len(plan.input_ids))

    def run_between_stages(self, plan, rows, ep=None) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and log-probs (S,) of a prefill step under PP, on every stage: hidden states in from the
        previous stage, the bucket's graph, hidden states out to the next, tokens from the last."""
        engine, n_tokens, n_sampled = self.engine, len(plan.input_ids), len(plan.sampled)
        self._replay(plan, rows, ep is None)
        engine.send_hidden(None if engine.groups.is_last_stage else self.hidden_out[:n_tokens])
        if n_sampled == 0:  # a chunk that completes no prompt (as eager: nothing to share)
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        return engine.share(self.sampled[:, :n_sampled] if engine.groups.is_last_stage else None, n_sampled)

    def launch(self, plan, rows, ep=None) -> Launched:
        """Starts a prefill step (one stage, no PP) and returns at once; ``.result()`` waits. Until the
        next prefill replays, sampled row r's token stays at the decode graphs'
        ``outputs[prefill_rows_base + r]`` (the next prefill reads its pending rows there before it
        writes its own). ``ep``: the EP group's agreed step (EP across DP): run uncaptured."""
        self._replay(plan, rows, ep is None)
        self.turn ^= 1
        return Launched.copy_out(self.sampled, self.out[self.turn], len(plan.sampled), self.expert_ids,
                                 len(plan.input_ids))

    def _replay(self, plan, rows, replay: bool = True) -> None:
        """Captures the bucket's graph if new, loads the inputs (and with PP the hidden states), replays
        (or with ``replay`` False runs the body uncaptured)."""
        n_tokens = len(plan.input_ids)
        t = self.bucket(plan)
        c = next(b for b in self.row_buckets if b >= max(len(plan.seqs), len(plan.sampled)))
        d = plan.decoding  # decode rows: the decode kernel over a bucket >= d, the prefill one from a bucket <= d
        dc = min(next(b for b in self.row_buckets if b >= d), t) if d else 0
        key = (t, c, dc, max((b for b in self.row_buckets if b <= d), default=0))
        if self.capture and replay and key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        self._load(plan, rows, t, c)
        if self.engine.receive_hidden(n_tokens, into=self.hidden_in[:n_tokens]) is not None:
            self.hidden_in[n_tokens:t].zero_()
        if self.capture and replay:
            self.graphs[key].replay()
        else:
            self._body(*key)

    def _body(self, t: int, c: int, dc: int, start: int) -> None:
        """The prefill of this stage on t padded tokens and c padded rows of the static buffers, the
        first dc of them (>= the step's decode rows) through the decode kernel, those from ``start``
        (<= them) through the prefill kernel."""
        engine, tok, row = self.engine, self.tokens[:, :t], self.rows
        src = tok[3]  # a mixed step's decode rows planned ahead: their tokens are still on the device
        ids = feed_tokens(src, self.outputs, tok[0])
        batch = ForwardBatch(ids, tok[1], tok[2], self.table[:c], row[0, :c], row[1, : c + 1], t, False,
                             engine.max_len, dc, start, row[5, : c + 1] if dc else None)
        x = None if engine.groups.is_first_stage else self.hidden_in[:t]
        forward = lambda: engine.compute(batch, x, row[2, :c])  # noqa: E731 ((c, V_padded) logits on the last stage)
        out = forward() if self.expert_ids is None else self.expert_ids.compute(engine.stage, t, forward)
        if not engine.groups.is_last_stage:
            self.hidden_out[:t].copy_(out)
            return
        self.shared.sample(out, row[3, :c], row[4, :c], self.sampled[:, :c])

    def _capture(self, *key: int) -> torch.cuda.CUDAGraph:
        for buffer in (self.tokens, self.rows, self.table, self.hidden_in):
            buffer.zero_()  # warm-up writes land in the scratch page
        return self.shared.capture(lambda: self._body(*key))

    def _load(self, plan, rows, t: int, c: int) -> None:
        """The step's inputs, padded (module docstring), into the static buffers: one `copy_words`."""
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have read them (a step may end unsynced)
        tok, row, table = (h.numpy() for h in self.host)
        n_tokens, n_seqs, n_sampled = len(plan.input_ids), len(plan.seqs), len(plan.sampled)
        tok[:, :t] = 0
        for i, name in enumerate(_TOKEN_FIELDS[:3]):
            tok[i, :n_tokens] = getattr(plan, name)
        tok[3, :t] = -1
        if plan.src_rows is not None:
            tok[3, :n_tokens] = plan.src_rows
        row[:, : c + 1] = 0
        row[0, :n_seqs] = plan.seq_lens
        row[1, : n_seqs + 1] = plan.cu_seqlens_q
        row[1, n_seqs + 1: c + 1] = n_tokens  # padded sequences: no queries
        row[5, : c + 1] = prefill_cu(row[1, : c + 1], plan.decoding)
        row[2, :n_sampled] = plan.sample_rows
        row[3, :n_sampled] = plan.seeds
        row[4, :n_sampled] = plan.offsets
        table[:c] = 0
        table[:n_seqs, : plan.block_table.shape[1]] = plan.block_table
        copy_words([(self.tokens, self.host[0]), (self.rows, self.host[1]), (self.table[:c], self.host[2][:c])])
        if self.copied is not None:
            self.copied.record()
        self.shared.load_sampling(rows)

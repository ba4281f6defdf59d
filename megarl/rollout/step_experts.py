"""The expert ids of a rollout step (``rollout.record_experts``, for router replay), eager or in a CUDA graph.

Every MoE layer's router appends its (T, k) ids to ``StageForward.moe_ids`` while the step runs.

- :class:`StepExperts` files a step's (T, layers, k) ids under its sequences: each sampled row's under
  the index of its token in the response, and a prefill chunk's prompt rows (but the last prompt
  token) in its sequence's ``prompt_experts``, shared with the forks that sample from that prefill;
  with the prefix cache, also every row at its K/V's cache row in the pool's
  :class:`~megarl.rollout.pages.PageExperts` (copy-on-write copies first, as the K/V's).
  It is made when the step runs, so it knows the forks even when the ids are read back later (a
  step launched ahead is recorded after the scheduler advanced it, which starts the forks decoding
  and forgets them).
- :class:`GraphIds` is what a captured step does instead of handing Python a list: inside the graph
  the ids go into one static device buffer (rows, layers, k) of small integers (uint8 below 256
  experts), and after each replay the step's rows go to a pinned host buffer in the same `copy_words`
  launch as the sampled tokens. Two host buffers are used in turn, as the tokens' are: a step launched
  ahead fills one while the pending step's ids wait in the other.

:func:`sequence_expert_ids` builds a sequence's record for its result.
"""
from __future__ import annotations

import numpy as np
import torch

from megarl.models.router_replay import ids_dtype, unrecorded_mark


def record_layout(stage) -> tuple[tuple[int, int], np.dtype]:
    """(layers, k) of one token's ids on ``stage`` (its MoE layers) and their numpy dtype."""
    moe = [lw.moe for lw in stage.layers if lw.moe is not None]
    return (len(moe), moe[0].topk), torch.empty(0, dtype=ids_dtype(stage.num_experts)).numpy().dtype


def small_ids(layer_ids: list, num_experts: int) -> torch.Tensor:
    """Each MoE layer's (T, k) int32 ids -> (T, layers, k) in the record's dtype (`ids_dtype`)."""
    return torch.stack(layer_ids, dim=1).to(ids_dtype(num_experts))


class StepExperts:
    """Where one step's expert ids go: made when the step runs, given the ids when they are on the host."""

    def __init__(self, plan, pages=None):
        self.plan, self.pages = plan, pages  # pages: the pool's PageExperts (the prefix cache keeps ids), or None
        # a prefill's sequences and their forks now (advancing the step forgets the forks)
        self.forks = [list(seq.forks) for seq in plan.seqs[plan.decoding:]] if not plan.decode else []

    def record(self, rows: np.ndarray) -> None:
        """(T, layers, k) ids of every row of the step (T: its tokens) -> its sequences' records."""
        plan = self.plan
        if self.pages is not None:  # after the steps recorded before it, as its K/V after theirs
            self.pages.copy(*plan.copies)
            self.pages.write(plan.slot_mapping, rows[:len(plan.slot_mapping)])
        picked = rows[np.asarray(plan.sample_rows)]  # (S, layers, k), a copy
        for row, (seq, offset) in enumerate(zip(plan.sampled, plan.offsets)):
            seq.experts[int(offset)] = picked[row]  # (layers, k)
        if not plan.decode:
            self._record_prompt(rows)

    def _record_prompt(self, rows: np.ndarray) -> None:
        """The prompt positions (but the last) of each prefill chunk, into its sequence's
        ``prompt_experts``: a chunk from position 0 starts a fresh array (a preempted sequence
        prefilled again keeps its siblings' record apart), which the sequence's forks share."""
        plan, cu = self.plan, self.plan.cu_seqlens_q
        for i, forks in zip(range(plan.decoding, len(plan.seqs)), self.forks):
            seq, start, end = plan.seqs[i], int(cu[i]), int(cu[i + 1])
            first, count = int(plan.positions[start]), len(seq.prompt) - 1  # positions first .. first + end - start - 1
            take = min(end - start, count - first)
            if take <= 0:
                continue  # a chunk of response tokens (a preempted sequence's recompute): recorded when decoded
            if first == 0 or seq.prompt_experts is None:
                seq.prompt_experts = np.full((count, *rows.shape[1:]), unrecorded_mark(rows.dtype), dtype=rows.dtype)
                for fork in forks:
                    fork.prompt_experts = seq.prompt_experts
            seq.prompt_experts[first:first + take] = rows[start:start + take]


class GraphIds:
    """A graph's static (rows, layers, k) expert-id buffer on the device and its two pinned host copies."""

    def __init__(self, stage, rows: int, device):
        self.num_experts, self.shape = stage.num_experts, record_layout(stage)[0]  # (layers, k) a row
        self.dtype = ids_dtype(stage.num_experts)
        self.row_bytes = self.shape[0] * self.shape[1] * torch.empty(0, dtype=self.dtype).element_size()
        words = self._words(rows)  # copy_words moves 32-bit words: the buffers are words, viewed as ids
        self.device = torch.zeros(words, dtype=torch.int32, device=device)
        host = [torch.zeros(words, dtype=torch.int32) for _ in range(2)]
        self.host = [h.pin_memory() for h in host] if device.type == "cuda" else host  # read by copy_words
        self.turn = 0

    def _words(self, rows: int) -> int:
        return -(-rows * self.row_bytes // 4)

    def _rows(self, words: torch.Tensor, rows: int) -> torch.Tensor:
        """(rows, layers, k) ids at the front of a word buffer."""
        return words.view(self.dtype)[: rows * self.shape[0] * self.shape[1]].view(rows, *self.shape)

    @staticmethod
    def of(engine, rows: int) -> "GraphIds | None":
        """The buffers of a graph of up to ``rows`` token rows of ``engine``: None unless it records experts."""
        stage = engine.stage
        return GraphIds(stage, rows, engine.device) if engine.options.record_experts and stage.has_moe else None

    def compute(self, stage, rows: int, forward):
        """In the graph: ``forward()``, each MoE layer's (rows, k) ids going into the device buffer."""
        stage.moe_ids = []
        out = forward()
        self._rows(self.device, rows).copy_(small_ids(stage.moe_ids, self.num_experts))
        stage.moe_ids = None
        return out

    def copy_pair(self, rows: int) -> tuple[tuple[torch.Tensor, torch.Tensor], np.ndarray]:
        """After a replay: the (host, device) pair that copies its first ``rows`` rows out (for
        `copy_words`, beside the tokens), and the (rows, layers, k) numpy view they land in."""
        self.turn ^= 1
        words, host = self._words(rows), self.host[self.turn]
        return (host[:words], self.device[:words]), self._rows(host, rows).numpy()

    def read(self, rows: int) -> np.ndarray:
        """The first ``rows`` rows now (waits for the device): (rows, layers, k)."""
        return self._rows(self.device, rows).cpu().numpy()


def sequence_expert_ids(seq) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A sequence's record for its result: (R, layers, k) the rows that sampled each response token —
    unrecorded at tokens no step of this call sampled (a resumed request's prefix, see
    megarl/rollout/expert_record.py) — and (P - 1, layers, k) its prompt's; (None, None) when no step
    recorded anything of it."""
    some = next(iter(seq.experts.values()), None)
    if some is None and seq.prompt_experts is None:
        return None, None
    shape, dtype = (some.shape, some.dtype) if some is not None else (seq.prompt_experts.shape[1:],
                                                                      seq.prompt_experts.dtype)
    mark = unrecorded_mark(dtype)
    response = np.full((len(seq.generated), *shape), mark, dtype)
    for i in range(len(seq.generated)):
        if i in seq.experts:
            response[i] = seq.experts[i]
    prompt = seq.prompt_experts
    if prompt is None:  # a one-token prompt has no prompt rows: (0, layers, k)
        prompt = np.full((max(len(seq.prompt) - 1, 0), *shape), mark, dtype)
    return response, prompt

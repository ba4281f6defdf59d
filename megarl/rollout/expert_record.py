"""Recorded expert ids (rollout routing replay) of a sequence that grows over several engine calls.

A record is per input *position* of the whole sequence, as megarl/models/router_replay.py lays
ids out in the batch: row t (layers, k) holds the experts that routed token t, the row whose
output predicts token t + 1. A :class:`~megarl.rollout.engine.GenerationResult` with prompt length P
and R response tokens holds positions 0 .. P - 2 in ``prompt_expert_ids`` and P - 1 .. P + R - 2 in
``expert_ids`` (:func:`positions` joins them; :func:`split` cuts a record back into the two).

Sequences grow across calls: a multi-turn conversation (each turn is a call whose prompt is
everything so far, megarl/rollout/agent.py), an HTTP agent's chain of calls
(megarl/rollout/http_sessions.py), a partial rollout resumed in a later step under new weights
(megarl/trainer/partial.py). Their records merge position by position and **the earliest record
wins** (:func:`merge`):

- a sampled token keeps the ids of the row that sampled it (its own call's step, under the
  policy that sampled it), whatever later calls computed again at that position (a later turn's
  prefill of the whole conversation, a resumed response prefilled under newer weights);
- appended context (tool results, user turns, the chat template's tokens between turns) is
  recorded as the next call's prefill routed it: like the R3 paper, every token the rollout
  computed is recorded, so the K/V a later turn attended to are replayed too;
- positions no call computed (a sequence's last token; a failed agent's fallback) hold the
  unrecorded mark, and the training router routes them by its own top-k.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from megarl.models.router_replay import unrecorded_mark


def positions(result) -> Optional[np.ndarray]:
    """A result's record, (P + R - 1, layers, k): prompt positions then response rows; None when the
    engine recorded nothing for it."""
    if result.expert_ids is None:
        return None
    prompt, want = result.prompt_expert_ids, max(len(result.prompt_ids) - 1, 0)
    if prompt is None:  # an engine that recorded no prompt rows: the router chooses there
        prompt = np.full((want, *result.expert_ids.shape[1:]), unrecorded_mark(result.expert_ids.dtype),
                         result.expert_ids.dtype)
    if len(prompt) != want or len(result.expert_ids) != len(result.response_ids):
        raise ValueError(f"request {result.key}: {len(prompt)} prompt and {len(result.expert_ids)} response rows "
                         f"of expert ids for {len(result.prompt_ids)} prompt and {len(result.response_ids)} "
                         "response tokens")
    return np.concatenate([prompt, result.expert_ids])


def merge(old: Optional[np.ndarray], new: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Two records of one sequence (new: a later call's, over the same leading positions) -> one as
    long as the longer, each position from ``old`` where it is recorded there, else from ``new``."""
    if old is None or new is None:
        return new if old is None else old
    mark = unrecorded_mark(old.dtype)
    out = np.full((max(len(old), len(new)), *old.shape[1:]), mark, old.dtype)
    out[:len(new)] = new
    kept = old[:, 0, 0] != mark  # (len(old),) recorded rows hold real ids at every layer
    out[:len(old)][kept] = old[kept]
    return out


def split(record: Optional[np.ndarray], prompt_len: int,
          response_len: int) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """A record -> (prompt_expert_ids (P - 1, ...), expert_ids (R, ...)) of a result with those lengths,
    cut or padded with the unrecorded mark; (None, None) for no record."""
    if record is None:
        return None, None
    want = max(prompt_len - 1, 0) + response_len
    if len(record) < want:
        pad = np.full((want - len(record), *record.shape[1:]), unrecorded_mark(record.dtype), record.dtype)
        record = np.concatenate([record, pad])
    cut = max(prompt_len - 1, 0)
    return record[:cut].copy(), record[cut:want].copy()

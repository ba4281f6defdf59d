"""Forward (and backward) over micro-batches through megatron-core's pipeline schedule.

:func:`run_pipeline` wraps ``get_forward_backward_func()``: the same call works
for pp = 1 (no pipelining), pp > 1 (1F1B) and interleaved chunks. The
schedule's contract: ``forward_step(batch, model)`` returns
``(output, loss_fn)``; on the last stage the schedule calls
``loss_fn(output)``, which returns ``(loss, extra)`` or
``(loss, num_tokens, extra)``; ``extra`` of every micro-batch is what
:func:`run_pipeline` returns there (optionally broadcast to every stage).
:func:`forward_logits` is the convenience built on it: full-vocab logits on
every rank.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_model_config
from torch import nn

from megarl.distributed.groups import ParallelGroups


def run_pipeline(
    model_chunks: nn.Module | Sequence[nn.Module], groups: ParallelGroups,
    microbatches: Sequence, forward_step: Callable, *, forward_only: bool,
    seq_length: int, micro_batch_size: int, broadcast: bool = False,
) -> list:
    """Runs every micro-batch through the stages; returns the loss functions' ``extra``s.

    On the last stage the list has one entry per micro-batch; on other stages it
    is empty unless ``broadcast`` (then every stage gets the last stage's list).
    ``seq_length`` / ``micro_batch_size`` give the activation shape sent between
    stages ([seq_length, micro_batch_size, hidden]); with pp > 1 the builder sets
    ``variable_seq_lengths``, so shapes may vary per micro-batch.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    config = get_model_config(chunks[0])
    vp = len(chunks) if len(chunks) > 1 else None
    iterators = [iter(microbatches) for _ in chunks]

    def step(data_iterator, model):
        return forward_step(next(data_iterator), model)

    kwargs = {}
    if groups.pp_size > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=groups.pp, config=config)
    results = get_forward_backward_func(pp_size=groups.pp_size, vp_size=vp)(
        forward_step_func=step, data_iterator=iterators if vp else iterators[0],
        model=chunks, num_microbatches=len(microbatches), seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only,
        pg_collection=groups.collection, **kwargs,
    )
    if broadcast and groups.pp_size > 1:
        box = [results if groups.is_last_stage else None]
        dist.broadcast_object_list(box, src=groups.pp_last_rank, group=groups.pp)
        results = box[0]
    return results


def _keep_output(output: torch.Tensor):
    return output.new_zeros(()), {"output": output.detach()}


def forward_logits(
    model: nn.Module, groups: ParallelGroups, input_ids: torch.Tensor, position_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None, packed_seq_params: Optional[PackedSeqParams] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """One forward pass; the model's output gathered over TP, on every rank.

    input_ids, position_ids: [b, s] (identical on every rank of a TP group).
    Returns [b, s, V] logits (``V`` cut to ``vocab_size`` when given, dropping
    padding rows) or [b, s, 1] values for a value model.
    """
    def forward_step(batch, model):
        ids, pos = batch
        out = model(ids, pos, attention_mask, packed_seq_params=packed_seq_params,
                    runtime_gather_output=True)  # [b, s, V] or [b, s, 1]
        return out, _keep_output

    with torch.no_grad():
        (result,) = run_pipeline(
            model, groups, [(input_ids, position_ids)], forward_step, forward_only=True,
            seq_length=input_ids.shape[1], micro_batch_size=input_ids.shape[0], broadcast=True,
        )
    out = result["output"]
    return out[..., :vocab_size] if vocab_size else out

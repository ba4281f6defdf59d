"""Value head: one scalar per token instead of vocab logits (critics, reward models).

:func:`megarl.models.builder.build_gpt_model` puts a :class:`ValueHead` in
place of GPTModel's ``output_layer`` when ``ModelInfo.value_head`` is set, so
the model's forward returns ``[b, s, 1]`` where a language model returns
``[b, s, V/tp]``. The head is a plain ``hidden -> 1`` linear replicated over TP
(the hidden state entering it is already identical on every TP rank), named
``output_layer.weight`` like the LM head it replaces; in a Hugging Face
``*ForSequenceClassification`` checkpoint it is ``score.weight``
``(num_labels=1, hidden)``.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from megarl.distributed.groups import ParallelGroups


class ValueHead(nn.Module):
    """``hidden [s, b, h] -> values [s, b, 1]``; call-compatible with ColumnParallelLinear."""

    def __init__(self, config: TransformerConfig, groups: ParallelGroups):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = groups.tp
        if self.sequence_parallel:  # grads of a replicated param then need a TP all-reduce
            self.weight.sequence_parallel = True

    def forward(
        self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> tuple[torch.Tensor, None]:
        values = hidden @ self.weight.t()  # [s(/tp), b, 1]
        if self.sequence_parallel:
            # every TP rank computes the loss from all the values: each gets the whole gradient back,
            # so the backward keeps this rank's slice (a reduce-scatter would count it tp times)
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)  # [s, b, 1]
        return values, None


def init_value_head(model: nn.Module, seed: int = 0, std: float = 0.0) -> None:
    """Fills the head with ``N(0, std)`` drawn from ``seed`` (zeros when std is 0).

    The draw uses its own generator, so every TP rank gets the same head.
    """
    head = getattr(model, "output_layer", None)
    if not isinstance(head, ValueHead):
        return  # not the last stage, or not a value model
    with torch.no_grad():
        if std == 0.0:
            head.weight.zero_()
            return
        gen = torch.Generator().manual_seed(seed)
        draw = torch.randn(head.weight.shape, generator=gen, dtype=torch.float32) * std
        head.weight.copy_(draw.to(head.weight.dtype))


def load_value_model(model: nn.Module, hf_dir: str, info, groups: ParallelGroups,
                     *, seed: int = 0, std: float = 0.0):
    """Fills a value model (built from ``info`` with ``value_head``) from ``hf_dir``.

    A ``*ForSequenceClassification`` checkpoint gives every weight, head
    included; a ``*ForCausalLM`` one gives the backbone, its ``lm_head`` goes
    unused and the head is drawn by :func:`init_value_head` (``seed``, ``std``).
    """
    from megarl.models.hf_config import read_hf_config
    from megarl.models.loader import load_hf_checkpoint
    from megarl.models.weight_map import SCORE

    if read_hf_config(hf_dir).value_head:
        return load_hf_checkpoint(model, hf_dir, info, groups)
    init_value_head(model, seed, std)
    return load_hf_checkpoint(model, hf_dir, info, groups, allow_missing=(SCORE,))

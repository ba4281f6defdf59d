"""The rollout forward of one pipeline stage, on the actor's own Megatron parameters.

:class:`StageForward` holds references to the parameters of this rank's
GPTModel stage (the very tensors the optimizer updates in place: no copy) and
runs the Llama-family decoder over a packed batch of new tokens with a paged KV
cache: embedding (vocab-parallel), per layer RMSNorm -> fused QKV -> (QK norm)
-> RoPE -> K/V written to the cache -> paged attention -> output projection
(all-reduced over TP) -> residual -> RMSNorm -> SwiGLU MLP (all-reduced) ->
residual; final norm and the vocab-parallel head on the last stage. A mixed step
(a prefill that also decodes the running sequences, ``ForwardBatch.decode_rows``)
attends its decode rows with the decode kernel and its prompt chunks with the
prefill kernel.

It is megatron-core's computation, op for op, written as functions: megatron's
modules are built for [s, b, h] training batches with their own static KV
cache, and each call walks ~15 modules per layer in Python. Here one decode
step is a fixed sequence of tensor ops on fixed-shape inputs, which is what a
CUDA graph captures, and the elementwise work between the GEMMs is fused
(``megarl_kernels``: residual add + RMSNorm, RoPE + K/V cache write — inside the
decode attention's launch on decode steps —, SiLU-mul;
on CPU the same calls run their torch specs). On CUDA decode steps at TP1 the
QKV projection, the output projection and fc2 run split-K into fp32 partials
that the next kernel sums (the decode attention, the add + RMSNorm;
``split_linear.py``): no reduction launch of cuBLAS's own. The QKV bias is
added on every path as megatron's local-spec linear adds it, to the rounded
matmul output (the decode attention kernel adds it on decode steps; prefill and
Qwen3's q/k-norm add it after ``F.linear``). Local-spec names
(``input_layernorm.weight``) and TE's fused ones (``linear_qkv.layer_norm_weight``) are both read. Tested against
training log-probs (fp32, 1e-5) and ``transformers`` greedy decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl_kernels.decode_plan import decode_plan
from megarl_kernels.dispatch import choose
from megarl_kernels.fc1_swiglu import fc1_silu_mul
from megarl_kernels.paged_attention import paged_decode_attention, paged_prefill_attention, rope_paged_decode
from megarl_kernels.rms_norm import add_rms_norm
from megarl_kernels.rope_cache import rope_cache
from megarl_kernels.swiglu import silu_mul
from megarl.rollout.moe_step import EpStep, MoeSums, MoeWeights, idle_layer, moe_mlp, moe_sums, moe_weights
from megarl.rollout.split_linear import split_k_linear, split_parts

@dataclass
class ForwardBatch:
    """Device tensors of one step (a :class:`~megarl.rollout.scheduler.StepPlan`)."""

    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    slot_mapping: torch.Tensor  # (T,) long flat cache row per token
    block_table: torch.Tensor  # (N, max_pages) int32
    seq_lens: torch.Tensor  # (N,) int32
    cu_seqlens_q: torch.Tensor  # (N + 1,) int32
    max_seqlen_q: int
    decode: bool  # one token per sequence (T == N)
    max_seqlen_k: int  # the engine's longest sequence: fixes the decode split count (graph == eager)
    # A mixed step (not decode): its first decode_rows rows go through the decode kernel (in a graph a
    # bucket >= the real count, which is cu_prefill[0]), and the prefill kernel takes the sequences from
    # prefill_from on (a bucket <= it: the decode ones among them get no queries from cu_prefill, i.e.
    # cu_seqlens_q through `prefill_cu`; fewer of them, fewer empty programs in its grid).
    decode_rows: int = 0
    prefill_from: int = 0
    cu_prefill: Optional[torch.Tensor] = None  # (N + 1,) int32


def prefill_cu(cu_seqlens_q, decoding: int):
    """(N + 1,) cu_seqlens_q of a mixed step whose first ``decoding`` sequences are decode rows, with
    those given no queries: every entry at least ``decoding`` (numpy or torch)."""
    return cu_seqlens_q.clip(min=decoding)


@dataclass
class LayerWeights:
    """One decoder layer's parameters (references, never copies)."""

    attn_norm: torch.Tensor  # (h,)
    qkv: torch.Tensor  # (ng/tp * (np/ng + 2) * hn, h)
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]  # (hn,)
    k_norm: Optional[torch.Tensor]
    proj: torch.Tensor  # (h, np/tp * hn)
    mlp_norm: torch.Tensor  # (h,)
    fc1: Optional[torch.Tensor]  # (2 * ffn/tp, h): gate rows, then up rows; None in an MoE layer
    fc2: Optional[torch.Tensor]  # (h, ffn/tp)
    lora: dict = field(default_factory=dict)  # linear name -> LoraWeights, where adapted
    moe: Optional[MoeWeights] = None  # a mixture-of-experts layer's router and experts (megarl.rollout.moe_step)


@dataclass
class LoraWeights:
    """One linear's adapter (megarl.models.lora): out += scale * (x a^T) b^T, split like the weight."""

    a: torch.Tensor  # column-parallel: (r, in); row-parallel: (r, in/tp)
    b: torch.Tensor  # column-parallel: (out/tp, r); row-parallel: (out, r)
    scale: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # row-parallel: this rank's partial (x_local a_local^T) b^T joins the output's TP all-reduce
        return self.scale * F.linear(F.linear(x, self.a), self.b)


def _norm_weight(layer, plain: str, fused: str) -> torch.Tensor:
    module = layer
    for name in plain.split("."):
        module = getattr(module, name)
    weight = getattr(module, "weight", None)
    if weight is not None:
        return weight
    owner = layer
    for name in fused.split("."):
        owner = getattr(owner, name)
    return owner  # TE: the norm is fused into the next linear


def _lora(linears: dict) -> dict:
    return {name: LoraWeights(m.lora_a, m.lora_b, m.lora_scale) for name, m in linears.items()
            if getattr(m, "lora_enabled", False)}


def _layer_weights(layer, groups) -> LayerWeights:
    attn, mlp = layer.self_attention, layer.mlp
    moe = moe_weights(mlp, groups)
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        moe.shared_lora = _lora({"fc1": shared.linear_fc1, "fc2": shared.linear_fc2})
    dense = {} if moe is not None else {"fc1": mlp.linear_fc1, "fc2": mlp.linear_fc2}
    q_norm = getattr(attn, "q_layernorm", None)
    k_norm = getattr(attn, "k_layernorm", None)
    return LayerWeights(
        attn_norm=_norm_weight(layer, "input_layernorm", "self_attention.linear_qkv.layer_norm_weight"),
        qkv=attn.linear_qkv.weight, qkv_bias=getattr(attn.linear_qkv, "bias", None),
        q_norm=getattr(q_norm, "weight", None), k_norm=getattr(k_norm, "weight", None),
        proj=attn.linear_proj.weight,
        mlp_norm=_norm_weight(layer, "pre_mlp_layernorm", "mlp.linear_fc1.layer_norm_weight"),
        fc1=dense["fc1"].weight if dense else None, fc2=dense["fc2"].weight if dense else None,
        lora=_lora({"qkv": attn.linear_qkv, "proj": attn.linear_proj, **dense}), moe=moe,
    )


class StageForward:
    """This rank's stage of the policy, as a function of a :class:`ForwardBatch` and the cache."""

    def __init__(self, module, groups, vocab_size: int):
        cfg = module.config
        self.module, self.groups, self.vocab_size = module, groups, vocab_size
        self.tp = groups.tp if groups.tp_size > 1 else None
        self.eps = cfg.layernorm_epsilon
        self.hidden = cfg.hidden_size
        self.head_dim = cfg.kv_channels
        self.heads = cfg.num_attention_heads // groups.tp_size
        self.kv_heads = cfg.num_query_groups // groups.tp_size
        self.scale = 1.0 / self.head_dim ** 0.5
        self.dtype = cfg.params_dtype
        self.layers = [_layer_weights(layer, groups) for layer in module.decoder.layers]
        moe = [lw.moe for lw in self.layers if lw.moe is not None]
        self.has_moe, self.num_experts = bool(moe), cfg.num_moe_experts or 0
        self.moe_ids: Optional[list] = None  # a list: each MoE layer's (T, k) expert ids of the step append
        self.real_rows: Optional[torch.Tensor] = None  # (T,) bool: the step's rows that are not padding
        # EP over several TP groups: the group's ranks run their MoE layers in lockstep (moe_step.EpStep);
        # TP / ETP > 1: the experts' partial sums are all-reduced (moe_step.MoeSums)
        self.ep = EpStep.of(groups, cfg.num_moe_experts) if moe else None
        self.moe_sums = moe_sums(groups) if moe else MoeSums((), None)
        self.first, self.last = groups.is_first_stage, groups.is_last_stage
        self.embedding = module.embedding.word_embeddings if self.first else None
        self.final_norm = module.decoder.final_layernorm.weight if self.last else None
        self.head = self._head_weight(module) if self.last else None
        self.cos, self.sin = self._rope_tables(module)  # (S_max, hn) in the model dtype
        # decode steps' QKV / proj / fc2 as split-K partials into the next kernel (CUDA only: bf16 -> fp32
        # bmm; not under TP, whose all-reduces want the summed outputs). CPU tests switch it on.
        self.split_k = self.tp is None and bool(self.layers) and self.layers[0].proj.is_cuda

    def refresh_experts(self) -> None:
        """Re-stacks SequentialMLP experts (moe_step.MoeWeights.refresh): once per generate call."""
        for lw in self.layers:
            if lw.moe is not None:
                lw.moe.refresh()

    def idle_step(self) -> None:
        """EP across DP, this rank idle (done, or waiting for follow-ups): one eager step of the group's
        (rows agreed, ``ep.agree``) with no rows of its own, its experts serving the others'."""
        device = self.layers[0].proj.device
        for lw in self.layers:
            if lw.moe is not None:
                idle_layer(lw.moe, self.ep, self.hidden, self.dtype, device)

    @staticmethod
    def _head_weight(module) -> torch.Tensor:
        if module.share_embeddings_and_output_weights:
            return module.shared_embedding_or_output_weight()
        return module.output_layer.weight  # (V/tp, h)

    def _rope_tables(self, module):
        """cos / sin of megatron's own RoPE frequencies, cast as megatron casts them."""
        # packed_seq: every position (under context parallelism megatron would keep this rank's chunks)
        freqs = module.rotary_pos_emb(module.max_sequence_length, packed_seq=True)  # (S, 1, 1, hn) fp32
        freqs = freqs.reshape(freqs.shape[0], -1)
        return torch.cos(freqs).to(self.dtype), torch.sin(freqs).to(self.dtype)

    def parameters(self) -> list[torch.Tensor]:
        """Every tensor the forward reads (for the CUDA-graph pointer check)."""
        out = [t for lw in self.layers for t in vars(lw).values() if isinstance(t, torch.Tensor)]
        out += [t for lw in self.layers if lw.moe is not None for t in lw.moe.tensors()]
        out += [t for lw in self.layers for ad in lw.lora.values() for t in (ad.a, ad.b)]
        extra = [self.embedding.weight if self.embedding is not None else None, self.final_norm, self.head]
        return out + [t for t in extra if t is not None]

    # -- the forward ---------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, h), vocab-parallel: rows outside this shard are zero, then all-reduced."""
        emb = self.embedding
        if self.tp is None:
            return F.embedding(ids, emb.weight)
        outside = (ids < emb.vocab_start_index) | (ids >= emb.vocab_end_index)
        local = torch.where(outside, 0, ids - emb.vocab_start_index)
        out = F.embedding(local, emb.weight).masked_fill(outside[:, None], 0.0)
        dist.all_reduce(out, group=self.tp)
        return out

    def layers_forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """(T, h) -> (T, h) through this stage's layers, writing their K/V into ``cache``: the residual
        stream, or on the last stage its final norm (the head's input, every row: a norm is per row).

        The residual stream and the next norm's output come from one fused add + RMSNorm
        (``megarl_kernels.rms_norm``), the same numbers as ``x = x + f(x); h = rms_norm(x)``.
        """
        h, residual = add_rms_norm(x, None, self.layers[0].attn_norm, self.eps)
        if self.ep is not None:  # the group agreed on the step's rows before it (EpStep.agree)
            self.ep.start(h.shape[0])
        if self.has_moe:  # a graph's padded rows write slot 0 (the scratch page, never a sequence's): no expert
            self.real_rows = batch.slot_mapping != 0
        mixed = self._mixed_rows(batch)
        plan = self._decode_plan(batch, mixed, cache.keys(0))
        for i, lw in enumerate(self.layers):
            attn = self._attention(h, lw, batch, cache.keys(i), cache.values(i), mixed, plan)
            h, residual = add_rms_norm(attn, residual, lw.mlp_norm, self.eps)
            norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.final_norm
            mlp = self._mlp(h, lw, batch.decode, split=batch.decode and norm is not None)  # split: summed by the norm
            if norm is None:  # an inner pipeline stage's last layer: the residual stream goes on
                return residual + mlp
            h, residual = add_rms_norm(mlp, residual, norm, self.eps)
        return h

    def _attention(self, h, lw: LayerWeights, batch: ForwardBatch, k_cache, v_cache, mixed=None, plan=None):
        t, g = h.shape[0], self.heads // self.kv_heads
        kernel_bias = lw.q_norm is None and "qkv" not in lw.lora  # the RoPE (+ attention) kernel adds it
        parts = self._parts(h, lw, "qkv", kernel_bias and batch.decode)
        if parts > 1:  # (S, T, ng * (g + 2) * hn) partials; the attention kernel sums them, adds the bias
            qkv = split_k_linear(h, lw.qkv, parts)
        else:  # (T, ng * (g + 2) * hn)
            qkv = self._linear(h, lw, "qkv", lw.qkv, None if kernel_bias else lw.qkv_bias)
        bias = lw.qkv_bias if kernel_bias else None
        if lw.q_norm is not None:  # Qwen3: per-head RMSNorm of queries and keys before RoPE, in place
            heads = qkv.view(t, self.kv_heads, g + 2, self.head_dim)
            heads[:, :, :g] = F.rms_norm(heads[:, :, :g], (self.head_dim,), lw.q_norm, self.eps)
            heads[:, :, g] = F.rms_norm(heads[:, :, g], (self.head_dim,), lw.k_norm, self.eps)
        if batch.decode:  # RoPE, this step's K/V into the cache and the attention in one kernel
            o = rope_paged_decode(qkv, self.cos, self.sin, batch.positions, batch.slot_mapping, k_cache, v_cache,
                                  batch.block_table, batch.seq_lens, self.scale, g, max_seqlen_k=batch.max_seqlen_k,
                                  bias=bias, plan=plan)
        else:
            q = rope_cache(qkv, self.cos, self.sin, batch.positions, batch.slot_mapping, k_cache, v_cache,
                           self.kv_heads, g, bias=bias)  # (T, np, hn); this step's K/V now in the cache
            o = self._prefill_attention(q, batch, k_cache, v_cache, mixed, plan)
        return self._row_parallel(o.reshape(t, -1), lw, "proj", lw.proj, split=batch.decode)

    def _prefill_attention(self, q, batch: ForwardBatch, k_cache, v_cache, mixed, plan):
        """(T, np, hn) attention of a prefill; a mixed step's decode rows (``mixed``: their block table,
        lengths and row mask, from `_mixed_rows`) through the decode kernel, which is built for them
        (its 128-key tiles on 8 warps at B = 128; the prefill kernel's 128-row tiles would hold 6 live
        rows), the prefill kernel over the sequences from ``prefill_from``."""
        if mixed is None:
            return paged_prefill_attention(q, k_cache, v_cache, batch.block_table, batch.cu_seqlens_q,
                                           batch.seq_lens, self.scale, max_seqlen_q=batch.max_seqlen_q)
        (table, lens, is_decode), prefill = mixed
        dc = table.shape[0]
        decoded = paged_decode_attention(q[:dc], k_cache, v_cache, table, lens, self.scale,
                                         max_seqlen_k=batch.max_seqlen_k, plan=plan)  # (dc, np, hn)
        o = paged_prefill_attention(q, k_cache, v_cache, *prefill, self.scale,
                                    max_seqlen_q=batch.max_seqlen_q)  # rows < cu_prefill[0] unset
        o[:dc] = torch.where(is_decode[:, None, None], decoded, o[:dc])  # select: unset rows may be NaN
        return o

    @staticmethod
    def _decode_plan(batch: ForwardBatch, mixed, k_cache):
        """Per step, once: the decode kernel's work plan (`decode_plan`: which program reads which key
        tiles, so a ragged batch's long rows spread over several) for the decode rows — a decode step's
        all, a mixed step's first ones —, shared by every layer; None on the torch path (CPU)."""
        lens = batch.seq_lens if batch.decode else mixed[0][1] if mixed is not None else None
        if lens is None or lens.shape[0] == 0 or choose("auto", lens, k_cache) != "triton":
            return None
        return decode_plan(lens, k_cache, batch.max_seqlen_k)

    @staticmethod
    def _mixed_rows(batch: ForwardBatch):
        """Per step, once (the CPU decode path remembers its gather plan by these tensors): the decode
        rows' block table, lengths and (dc,) mask of the real ones, and the prefill kernel's block
        table, cu and lengths from ``prefill_from``; None unless a mixed step."""
        dc, start = batch.decode_rows, batch.prefill_from
        if batch.decode or dc == 0:
            return None
        rows = torch.arange(dc, device=batch.seq_lens.device)
        decode = batch.block_table[:dc], batch.seq_lens[:dc], rows < batch.cu_prefill[0]
        return decode, (batch.block_table[start:], batch.cu_prefill[start:], batch.seq_lens[start:])

    def _mlp(self, h, lw: LayerWeights, decode: bool, split: bool):
        """fc2(SwiGLU(fc1(h))); a decode step's fc1 and SwiGLU as one kernel (`fc1_silu_mul`: Hopper or
        newer, up to its row limit; else the same two ops) unless fc1 has an adapter."""
        if lw.moe is not None:  # router + routed experts (+ shared expert), summed in (T, h)
            return moe_mlp(h, lw.moe, self.ep, self.moe_ids, self.moe_sums, self.real_rows)
        if decode and "fc1" not in lw.lora:
            act = fc1_silu_mul(h, lw.fc1)
        else:
            act = silu_mul(self._linear(h, lw, "fc1", lw.fc1))
        return self._row_parallel(act, lw, "fc2", lw.fc2, split)

    def _parts(self, x, lw: LayerWeights, name: str, split: bool) -> int:
        """Split-K slices for linear ``name`` on input x (1: the plain linear): only where asked,
        with `split_k` on and no adapter on that linear."""
        return split_parts(name, x.shape[0], x.shape[1]) if split and self.split_k and name not in lw.lora else 1

    def _row_parallel(self, x, lw: LayerWeights, name: str, weight, split: bool):
        """A row-parallel linear for the next add + RMSNorm: (T, h) all-reduced over TP, or with
        ``split`` (`_parts`) its (S, T, h) fp32 split-K partials."""
        parts = self._parts(x, lw, name, split)
        if parts > 1:
            return split_k_linear(x, weight, parts)
        return self._all_reduce(self._linear(x, lw, name, weight))

    @staticmethod
    def _linear(x, lw: LayerWeights, name: str, weight, bias=None):
        """x W^T, then + bias (rounded twice, as megatron's column-parallel linear), then the adapter."""
        out = F.linear(x, weight)
        if bias is not None:
            out = out + bias
        adapter = lw.lora.get(name)
        return out if adapter is None else out + adapter(x)

    def _all_reduce(self, x):
        if self.tp is not None:
            dist.all_reduce(x, group=self.tp)
        return x

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """(S, h) final-normed hidden states (`layers_forward` on the last stage) -> (S, V_padded) logits
        gathered over TP."""
        local = F.linear(normed, self.head)  # (S, V/tp)
        if self.tp is None:
            return local
        s, v_local = local.shape
        parts = local.new_empty((self.groups.tp_size * s, v_local))  # TP rank r's rows at r * S
        dist.all_gather_into_tensor(parts, local.contiguous(), group=self.tp)
        return parts.view(-1, s, v_local).permute(1, 0, 2).reshape(s, -1)  # (S, tp * V/tp)

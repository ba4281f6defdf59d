"""SGLang rollout: one SGLang engine per TP group, colocated on the group's GPUs.

Pinned to ``sglang==0.5.23``: ``tests/data/sglang_0.5.23_api.json`` lists every
method, keyword, field, tag and result key used here; test_rollout_sglang_api.py
checks this file against it and it against the wheel's source.

Layout (PP = 1, CP = 1). TP rank 0 of each TP group starts SGLang's offline
engine (``sglang.srt.entrypoints.engine.Engine``) with ``tp_size`` = the TP size
and ``base_gpu_id`` = its own GPU, so SGLang's TP worker ``i`` shares TP rank
``i``'s GPU (one node, consecutive GPUs, each process seeing all of them:
torchrun's default). Only that rank talks to SGLang; each call's result, or its
error, reaches the other TP ranks by ``broadcast_object_list`` over the TP
group. The start runs with the process state restored afterwards and its TP
peers waiting on a group with ``start_timeout_s`` (megarl/rollout/sglang_process.py).

generate: token in / token out (``skip_tokenizer_init``); one SGLang request per
:class:`~megarl.rollout.engine.Request`, in order, with ``sampling_seed`` = the
request's seed (SGLang's radix cache shares the prefill of identical prompts).
SGLang honours the seed only under ``enable_deterministic_inference``
(``deterministic``, default off: slower kernels, and at TP > 1 SGLang pins
``NCCL_ALGO`` for its workers); off, tokens depend on SGLang's batching.
Stops: ``eos_ids`` + ``params.stop_token_ids``; none: ``ignore_eos``
(otherwise SGLang also stops at the model config's eos).
Log-probs: ``meta_info["output_token_logprobs"]``, (logprob, token id, text)
per token, computed under the temperature (greedy: 1.0) before top-k / top-p.
Finish types "stop" / "length" map through; "abort" raises.

Expert ids (``record_experts``: ``actor.router_replay=r3`` or ``rollout.record_experts``, MoE model):
SGLang starts with ``enable_return_routed_experts`` (its routed-experts capturer: every forward writes
each token's top-k ids per layer into a host buffer indexed by KV slot) and each request asks for
``return_routed_experts``. A finished request's ``meta_info["routed_experts"]`` is the base64 of an int32
(P + R - 1, num_hidden_layers, num_experts_per_tok) array (positions 0 .. P + R - 2, read through its KV
slots; shared experts fused into the top-k are cut off; every layer is MoE, which megarl requires):
prompt tokens 0 .. P - 2 and then the row that sampled each response token, megarl's record layout
(megarl/rollout/expert_record.py), so :func:`parse_experts` splits it into ``prompt_expert_ids`` and
``expert_ids`` in the dtype of router_replay.ids_dtype. A radix-cache hit's prefix rows are the ids of
the forward that computed those KV slots: an earlier request of this call or since the last weight sync
(the cache is flushed at every sync), under the same weights. Without the capturer SGLang returns no key;
then no result carries ids (the trainer's r3 check names the fix), and a call where only some do is an error.

update_weights: :func:`~megarl.rollout.weight_stream.iter_hf_buckets` (the HF
export's tensors, cast to ``dtype``) in buckets of at most ``update_bucket_mb``
on every TP rank; each rank serializes its own copy and TP rank 0 sends one
``LocalSerializedTensor`` per tensor (megarl/rollout/sglang_shards.py) to
``update_weights_from_tensor`` between ``begin_weight_update`` and
``end_weight_update``, then ``flush_cache``. The engine starts with
``load_format="dummy"``.

Memory (``enable_memory_saver``). release_memory: ``flush_cache`` (it fails
unless SGLang is idle), then ``release_memory_occupation`` of the kv_cache,
weights and cuda_graph tags. SGLang re-maps released weights without their
values unless ``weights_cpu_backup``; the weights are then *stale*, as they are
at the start, and the next resume_memory or generate streams the actor's
weights first (a resumed run samples from its checkpoint, a rollout-only run
from the same weights every step). Resumes go weights first, then kv_cache and
cuda_graph, each after every TP rank emptied torch's CUDA cache: SGLang sized
its pool from the memory free when it started (``mem_fraction_static`` is a
share of that), and the activations torch keeps cached after a training step
would otherwise leave too little for it to map back.

Dedicated rollout ranks (``trainer.mode=async``, megarl/trainer/async_rollout.py): ``module`` is None;
the weights come only through :meth:`SGLangEngine.load_weights`, the training ranks' push (its buckets'
HF tensors, as received: the same session, calls and flush as a sync, from tensors every TP rank
already holds in full). Nothing trains on those GPUs, so the engine starts with
``enable_memory_saver`` and ``weights_cpu_backup`` off and its memory is never released or resumed
(it keeps its weights' values between pushes); a generate before the first push is an error, not a
sample from the dummy weights.

Verified only where SGLang is installed (the CPU tests use a fake engine with
its signatures, output format and the behaviours above): that Engine starts
with these arguments beside Megatron, that its ``load_weights`` takes the
streamed names, that CUDA IPC tensors reach its workers, that seeds make tokens
batch-independent, that its log-probs match the training forward, what
release_memory frees, and that its routed experts come back in the layout above
(and agree with the training router in bf16).
"""
from __future__ import annotations

import base64
import importlib.util
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megarl.errors import ConfigError
from megarl.distributed import ParallelGroups
from megarl.models.hf_config import ModelInfo
from megarl.models.router_replay import ids_dtype
from megarl.rollout.engine import GenerationResult, Request, SamplingParams
from megarl.rollout.expert_record import split
from megarl.rollout.sglang_process import isolated_process_state, startup_group
from megarl.rollout.sglang_shards import gather_bucket
from megarl.rollout.weight_stream import NamedTensors, iter_hf_buckets, tensor_bytes

SGLANG_VERSION = "0.5.23"
NOT_INSTALLED = (f"rollout.engine=sglang: SGLang is not installed (pip install sglang=={SGLANG_VERSION}); "
                 "use rollout.engine=native")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
_KV_TAGS = ("kv_cache", "cuda_graph")
_FINISH = {"stop": "stop", "length": "length"}  # SGLang finish_reason["type"] -> megarl
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SGLangOptions:
    """How the SGLang engine is started and fed (from ``rollout.*``)."""

    model_path: str  # HF directory; SGLang reads config.json from it (weights come from the actor)
    mem_fraction_static: float = 0.5  # share of the GPU memory free when SGLang starts, for weights + KV cache
    dtype: str = "bfloat16"  # SGLang's dtype; the streamed weights are cast to it
    seed: int = 1234  # SGLang's random_seed
    deterministic: bool = False  # enable_deterministic_inference: per-request seeds are honoured
    enable_memory_saver: bool = True  # release_memory / resume_memory free and re-map GPU memory
    weights_cpu_backup: bool = False  # SGLang keeps a CPU copy of released weights (else: re-synced)
    max_running_requests: int = 0  # 0: SGLang's default
    nccl_port: int = 0  # 0: SGLang picks one; else nccl_port + global rank of TP rank 0 (one per engine)
    update_bucket_mb: float = 512.0  # weight-sync bucket size
    start_timeout_s: float = 1800.0  # how long TP peers wait for TP rank 0 to start the engine
    record_experts: bool = False  # MoE: each token's top-k expert ids per layer in the results (router replay)


def load_engine_class() -> Callable:
    """SGLang's offline engine class; :class:`ConfigError` (one line) when sglang does not import."""
    try:
        from sglang.srt.entrypoints.engine import Engine
    except ImportError as e:
        raise ConfigError(NOT_INSTALLED) from e
    return Engine


def load_tensor_wrapper() -> Callable:
    """SGLang's per-TP-rank serialized tensor class (``values``: one payload per TP worker)."""
    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    except ImportError as e:
        raise ConfigError(NOT_INSTALLED) from e
    return lambda values: LocalSerializedTensor(values=values)


def _server_kwargs(o: SGLangOptions, tp_size: int, base_gpu_id: int, nccl_port: Optional[int]) -> dict:
    """Keyword arguments of ``Engine(...)`` (fields of SGLang's ServerArgs)."""
    return {"model_path": o.model_path, "tp_size": tp_size, "base_gpu_id": base_gpu_id,
            "mem_fraction_static": o.mem_fraction_static, "dtype": o.dtype, "random_seed": o.seed,
            "load_format": "dummy", "skip_tokenizer_init": True, "enable_memory_saver": o.enable_memory_saver,
            "enable_weights_cpu_backup": o.weights_cpu_backup,
            "enable_deterministic_inference": o.deterministic, "nccl_port": nccl_port,
            "max_running_requests": o.max_running_requests or None,
            "enable_return_routed_experts": o.record_experts}


def _sampling_kwargs(params: SamplingParams, seed: int, max_new_tokens: int, stops: list[int]) -> dict:
    """One request's ``sampling_params`` dict (fields of SGLang's SamplingParams)."""
    return {"max_new_tokens": max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "stop_token_ids": stops or None, "ignore_eos": not stops,
            "sampling_seed": seed}


def build_requests(requests: list[Request], params: SamplingParams, eos_ids: list[int]) -> list[dict]:
    """SGLang sampling dicts, one per request, in order: its own seed (as is) and length limit."""
    stops = sorted(set(eos_ids) | set(params.stop_token_ids))
    return [_sampling_kwargs(params, r.seed, r.max_new_tokens, stops) for r in requests]


def parse_output(out: dict, k: int) -> tuple[list[int], list[float], str]:
    """(response ids, log-probs, finish reason) of SGLang's result dict for request ``k``."""
    meta = out["meta_info"]
    reason = meta["finish_reason"]
    kind = reason["type"] if isinstance(reason, dict) else None
    if kind not in _FINISH:
        raise RuntimeError(f"SGLang request {k} did not finish normally: {reason!r}")
    ids = [int(t) for t in out["output_ids"]]
    entries = meta["output_token_logprobs"]
    if [int(e[1]) for e in entries] != ids:
        raise RuntimeError(f"SGLang request {k}: output_token_logprobs do not match output_ids")
    return ids, [float(e[0]) for e in entries], _FINISH[kind]


def parse_experts(out: dict, k: int, prompt_len: int, response_len: int,
                  info: ModelInfo) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(prompt_expert_ids (P - 1, layers, topk), expert_ids (R, layers, topk)) of SGLang's result dict for
    request ``k``, in router_replay.ids_dtype; None when it carries no ``routed_experts``."""
    meta = out["meta_info"]
    if "routed_experts" not in meta:
        return None
    moe = info.moe
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    shape = (prompt_len + response_len - 1, info.num_layers, moe.topk)  # positions 0 .. P + R - 2
    if flat.size != np.prod(shape):
        raise RuntimeError(f"SGLang request {k}: routed_experts hold {flat.size} ids, not {shape[0]} rows "
                           f"(P + R - 1 = {prompt_len} + {response_len} - 1) of ({shape[1]} layers, top-{shape[2]})")
    ids = flat.reshape(shape)
    if ids.size and (ids.min() < 0 or ids.max() >= moe.num_experts):
        raise RuntimeError(f"SGLang request {k}: routed_experts hold ids outside 0 .. {moe.num_experts - 1}")
    dtype = np.uint8 if ids_dtype(moe.num_experts) == torch.uint8 else np.int16
    return split(ids.astype(dtype), prompt_len, response_len)


def _check(result, what: str) -> None:
    """SGLang's (success, message) answers."""
    ok, message = result
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _base_gpu_id(groups: ParallelGroups) -> int:
    """TP rank 0's GPU; the TP group must be on one node, on consecutive GPUs. 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    peers = [None] * groups.tp_size
    dist.all_gather_object(peers, (socket.gethostname(), torch.cuda.current_device()), group=groups.tp)
    host, base = peers[0]
    if any(p != (host, base + i) for i, p in enumerate(peers)):
        raise ConfigError(f"rollout.engine=sglang: a TP group must be on one node on consecutive GPUs; "
                          f"got (host, GPU) per TP rank {peers}")
    return base


def _check_layout(groups: ParallelGroups) -> None:
    if groups.pp_size > 1:
        raise ConfigError("rollout.engine=sglang needs parallel.pp=1 (SGLang holds the whole model per "
                          "TP group); use rollout.engine=native with pipeline parallelism")
    if getattr(groups, "cp_size", 1) > 1:
        raise ConfigError("rollout.engine=sglang needs parallel.cp=1 (each CP rank would sample its own "
                          "responses for the same rows); use rollout.engine=native with context parallelism")


class SGLangEngine:
    """RolloutEngine on SGLang; one engine per TP group, on TP rank 0 (see the module docstring).

    Every public method is collective over the TP group; the memory state (``released``,
    ``weights_stale``) is the same on every TP rank.
    """

    def __init__(self, module, groups: ParallelGroups, info: ModelInfo, eos_ids: list[int],
                 options: SGLangOptions, engine_factory: Optional[Callable] = None,
                 tensor_wrapper: Optional[Callable] = None):
        """``module``: the actor whose weights are streamed in, or None when they are pushed through
        :meth:`load_weights`; ``engine_factory(**server kwargs)`` builds the engine (default: SGLang's
        Engine class); ``tensor_wrapper(values)`` wraps one tensor's per-TP-rank payloads (default: SGLang's)."""
        _check_layout(groups)
        if options.record_experts and getattr(info, "moe", None) is None:
            raise ConfigError("rollout.engine=sglang records expert ids (actor.router_replay=r3) of a "
                              "mixture-of-experts model only; set actor.router_replay=none")
        if engine_factory is None and importlib.util.find_spec("sglang") is None:
            raise ConfigError(NOT_INSTALLED)
        self.module, self.groups, self.info, self.options = module, groups, info, options
        self.eos_ids = list(eos_ids)
        self.is_src = groups.tp_rank == 0
        self.engine = None
        self.released: set[str] = set()
        self.weights_stale = True  # load_format="dummy": the first resume or generate streams the weights
        self.stats: dict[str, float] = {}
        self.wrap = tensor_wrapper or (load_tensor_wrapper() if self.is_src else None)
        base = _base_gpu_id(groups)
        port = options.nccl_port + groups.tp_src_rank if options.nccl_port else None
        kwargs = _server_kwargs(options, groups.tp_size, base, port)
        waiting = startup_group(groups, options.start_timeout_s)
        self._call(lambda: self._start(engine_factory or load_engine_class(), kwargs), group=waiting)

    def _start(self, factory: Callable, kwargs: dict) -> None:
        with isolated_process_state():
            self.engine = factory(**kwargs)

    # -- RolloutEngine -------------------------------------------------------
    def generate(self, requests: list[Request], params: SamplingParams) -> list[GenerationResult]:
        """One result per request, in request order, under its key (same on every TP rank)."""
        if any(len(r.prompt) == 0 for r in requests):
            raise ValueError("SGLang rollout: every prompt needs at least one token")
        if any(r.prefix for r in requests):
            raise ValueError("SGLang rollout: requests resumed from a prefix (rollout.partial) need the native engine")
        if not requests:
            self.stats = {"rollout/requests": 0.0}
            return []
        self.resume_memory()
        sampling = build_requests(requests, params, self.eos_ids)
        outputs, self.stats = self._call(lambda: self._generate([list(r.prompt) for r in requests], sampling))
        return [GenerationResult(list(r.prompt), ids, lps, reason, r.key, prompt_expert_ids=experts[0],
                                 expert_ids=experts[1]) for r, (ids, lps, reason, experts) in zip(requests, outputs)]

    def _generate(self, input_ids: list[list[int]], sampling: list[dict]):
        """(ids, log-probs, finish reason, (prompt expert ids, expert ids) or (None, None)) per request, stats."""
        start = time.perf_counter()
        raw = self.engine.generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True,
                                   return_routed_experts=self.options.record_experts)
        outputs = [parse_output(out, k) for k, out in enumerate(raw)]
        experts = [parse_experts(out, k, len(p), len(o[0]), self.info) if self.options.record_experts else None
                   for k, (out, p, o) in enumerate(zip(raw, input_ids, outputs))]
        missing = [k for k, e in enumerate(experts) if e is None]
        if self.options.record_experts and 0 < len(missing) < len(experts):
            raise RuntimeError(f"SGLang request {missing[0]}: no routed_experts in its result while other "
                               "requests of the call have them")
        stats = {"rollout/requests": float(len(sampling)), "rollout/engine_seconds": time.perf_counter() - start,
                 "rollout/response_tokens": float(sum(len(ids) for ids, _, _ in outputs))}
        return [(*o, e or (None, None)) for o, e in zip(outputs, experts)], stats

    def update_weights(self) -> dict:
        """Streams the actor's weights into SGLang (weights resumed first, the KV cache left as it is).
        Metrics: bytes (one TP rank's copy), seconds, buckets."""
        if self.module is None:
            raise RuntimeError("SGLang rollout: this engine has no actor to stream from; its weights come "
                               "through load_weights (the async weight push), and none has come yet")
        self._resume(("weights",))
        limit = int(self.options.update_bucket_mb * 2**20)
        dtype = _DTYPES[self.options.dtype]
        return self._load(iter_hf_buckets(self.module, self.groups, self.info, limit, dtype, every_rank=True))

    def load_weights(self, buckets: Iterable[dict[str, torch.Tensor]]) -> dict:
        """Hugging Face tensors from elsewhere into SGLang, cast to its dtype: the async weight push
        (megarl/trainer/weight_push.py), where every TP rank iterates over the same buckets, each holding the
        full tensors on its own device. One weight-update session, then a flush; metrics as update_weights.
        The weights must be resident (a dedicated rollout rank never releases them)."""
        if "weights" in self.released:
            raise RuntimeError("SGLang rollout: load_weights while SGLang's weights are released")
        dtype = _DTYPES[self.options.dtype]
        return self._load([(name, t.to(dtype)) for name, t in bucket.items()] for bucket in buckets)

    def _load(self, buckets: Iterable[NamedTensors]) -> dict:
        """One weight-update session over ``buckets`` (collective over TP: every rank the same names)."""
        start = time.perf_counter()
        self._call(lambda: _check(self.engine.begin_weight_update(), "begin_weight_update"))
        nbytes, count = 0, 0
        try:
            for bucket in buckets:
                count += 1
                nbytes += sum(tensor_bytes(t) for _, t in bucket)
                named = gather_bucket(bucket, self.groups, self.wrap)  # on TP rank 0; others keep `bucket` alive
                self._call(lambda: _check(self.engine.update_weights_from_tensor(
                    named_tensors=named, load_format=None, flush_cache=False), "update_weights_from_tensor"))
        except RuntimeError:  # raised on every TP rank (by _call, or by the push's checks): close SGLang's
            self._call(lambda: self.engine.end_weight_update())  # session so a retry can begin
            raise
        self._call(self._end_update)
        self.weights_stale = False
        return {"weight_sync/bytes": float(nbytes), "weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/buckets": float(count)}

    def _end_update(self) -> None:
        _check(self.engine.end_weight_update(), "end_weight_update")
        self._flush("after a weight update")

    def release_memory(self) -> None:
        """Frees SGLang's KV cache, weights and CUDA graphs (with enable_memory_saver); flushes first."""
        if not self.options.enable_memory_saver:
            return
        tags = [t for t in MEMORY_TAGS if t not in self.released]
        if tags:
            self._call(lambda: self._release(tags))
            self.released.update(tags)
            if "weights" in tags and not self.options.weights_cpu_backup:
                self.weights_stale = True  # SGLang re-maps them without their values

    def resume_memory(self) -> None:
        """Weights back and current (streamed again when stale), then the KV cache and CUDA graphs."""
        if self.weights_stale:
            self.update_weights()
        else:
            self._resume(("weights",))
        self._resume(_KV_TAGS)

    def close(self) -> None:
        """Shuts the SGLang engine down (its scheduler processes exit)."""
        self._call(lambda: self.engine.shutdown())

    # -- helpers ---------------------------------------------------------------
    def _flush(self, when: str) -> None:
        flushed = self.engine.flush_cache()
        if not getattr(flushed, "success", True):
            raise RuntimeError(f"SGLang flush_cache {when} failed (requests still running?): "
                               f"{getattr(flushed, 'message', '')}")

    def _release(self, tags: list[str]) -> None:
        self._flush("before releasing memory")  # SGLang releases only when idle
        self.engine.release_memory_occupation(tags=tags)

    def _resume(self, wanted: tuple[str, ...]) -> None:
        """Re-maps the released tags among ``wanted`` after every TP rank emptied torch's CUDA cache."""
        tags = [t for t in MEMORY_TAGS if t in wanted and t in self.released]  # SGLang raises on others
        if not tags:
            return
        torch.cuda.empty_cache()  # SGLang's worker on this rank's GPU maps what torch gives back
        if self.groups.tp_size > 1:
            dist.barrier(group=self.groups.tp)
        self._call(lambda: self.engine.resume_memory_occupation(tags=tags))
        self.released.difference_update(tags)

    def _call(self, fn: Callable, group: Optional[dist.ProcessGroup] = None):
        """``fn()`` on TP rank 0, its value (or its error) on every TP rank (over ``group``, default TP)."""
        box, error = [None], None
        if self.is_src:
            try:
                box[0] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = e
                box[0] = ("config" if isinstance(e, ConfigError) else "error", f"{type(e).__name__}: {e}")
        if self.groups.tp_size > 1:
            dist.broadcast_object_list(box, src=self.groups.tp_src_rank, group=group or self.groups.tp)
        status, value = box[0]
        if error is not None:
            raise error
        if status == "config":
            raise ConfigError(value.split(": ", 1)[1])
        if status == "error":
            raise RuntimeError(f"SGLang engine (on TP rank 0) failed: {value}")
        return value

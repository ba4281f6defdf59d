"""A stand-in for SGLang 0.5.23's offline ``Engine`` that behaves as SGLang does where the adapter can go wrong.

Names and formats: the method and parameter names of ``sglang.srt.entrypoints.engine.Engine`` for
everything the adapter calls (test_rollout_sglang_api.py checks them against the manifest); result
dicts with ``output_ids`` and ``meta_info`` holding ``finish_reason`` {"type": ...} and
``output_token_logprobs`` as (logprob, token id, None).

Behaviours (each the SGLang 0.5.23 code path named):
- process state (``_set_envs_and_config``, ``configure_logger``, the attention hook under
  deterministic inference): ``__init__`` sets CUDA/NCCL environment variables (``NCCL_ALGO`` and the
  NCCL channel counts at TP > 1 when deterministic), the ``spawn`` start method, a SIGQUIT handler,
  ``logging.basicConfig(force=True)`` and gc thresholds.
- memory (``enable_memory_saver``): at start the pool is ``mem_fraction_static`` of the memory free on
  :data:`GPU` (weights, KV cache, CUDA graphs); ``resume_memory_occupation`` maps each tag back only if
  the GPU has that much free now, else raises "CUDA out of memory". Released weights come back without
  their values unless ``enable_weights_cpu_backup``; a tag resumed that was not released raises.
  Without ``enable_memory_saver`` (SGLang's no-op memory saver adapter) a release frees nothing and the
  weights keep their values.
- weights: ``load_format="dummy"`` starts with values no one chose; ``update_weights_from_tensor`` only
  between ``begin_weight_update`` and ``end_weight_update``; each of its ``tp_size`` workers reads its
  own payload of every wrapped tensor (``values[worker]``, as ``LocalSerializedTensor``).
- idleness (``release_memory_occupation`` asserts the scheduler is idle, ``flush_cache`` reports it):
  ``running`` requests make ``flush_cache`` fail, and a release while running kills the fake (as the
  assertion kills SGLang's scheduler process); a dead fake answers nothing.
- routed experts (``RoutedExpertsCapturer``, ``_maybe_collect_routed_experts``, the tokenizer manager's
  base64): only when started with ``enable_return_routed_experts`` and asked per call with
  ``return_routed_experts`` does a result's ``meta_info`` carry ``routed_experts``, the base64 of an int32
  (P + R - 1, num_hidden_layers, num_experts_per_tok) array: each layer's router top-k (largest first) for
  prompt + response tokens but the last, as ``transformers`` routes them with the weights the fake holds
  (upcast to float32; the dummy start: seeded random values). The tokens themselves stay the fake's
  random ones, not the model's.
Every generate records a checksum of the weights it sampled from (None: values no one chose).
"""
from __future__ import annotations

import base64
import gc
import logging
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch


class FakeGPU:
    """Memory of TP rank 0's GPU in units: the trainer's torch allocator (allocated + cached) and SGLang's."""

    def __init__(self, total=10**9, trainer_allocated=0, trainer_cached=0):
        self.total, self.trainer_allocated, self.trainer_cached, self.engine = total, trainer_allocated, trainer_cached, 0

    def free(self) -> int:
        return self.total - self.trainer_allocated - self.trainer_cached - self.engine

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache: the cached blocks go back to the GPU."""
        self.trainer_cached = 0


GPU = FakeGPU()
WEIGHT_UNITS, GRAPH_UNITS = 5, 1  # the rest of the pool is KV cache


@dataclass
class FakeSerialized:
    """SGLang's ``LocalSerializedTensor``: one ForkingPickler payload per TP worker."""

    values: list

    def get(self, rank: int):
        return ForkingPickler.loads(self.values[rank])


def checksum(named: dict) -> float:
    """One number for a set of named tensors (None-free dicts only)."""
    return float(sum((k + 1) * t.double().sum() for k, (_, t) in enumerate(sorted(named.items()))))


def hf_model(model_path: str, weights: dict | None):
    """A float32 ``transformers`` model of ``model_path``'s config.json holding ``weights`` (HF names, as
    streamed); seeded random values for None (the dummy start), the caller's random state untouched."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.random.fork_rng(devices=[]):  # (the CPU CUDA shim has no device RNG to fork)
        torch.manual_seed(0)
        if weights is None:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(os.path.join(model_path, "config.json"), tmp)
            save_file({n: t.float().contiguous() for n, t in weights.items()}, os.path.join(tmp, "model.safetensors"))
            return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def routed_experts(model, tokens: list[int]):
    """(len(tokens) - 1, layers, k) int32 numpy: each layer router's top-k experts (largest probability
    first) of every token but the last."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k, rows = model.config.num_experts_per_tok, len(tokens) - 1
    return torch.stack([torch.topk(logits[:rows].softmax(-1), k).indices for logits in out.router_logits],
                       dim=1).to(torch.int32).numpy()


class FakeEngine:
    """Stands in for ``sglang.srt.entrypoints.engine.Engine`` (0.5.23) and records every call."""

    delay_s = 0.0  # a slow start (tests of the start timeout)

    def __init__(self, **kwargs):
        self.calls = [("__init__", kwargs)]
        self._configure_process(kwargs)
        time.sleep(self.delay_s)
        self.kwargs, self.tp = kwargs, kwargs["tp_size"]
        pool = int(kwargs["mem_fraction_static"] * GPU.free())
        self.sizes = {"weights": WEIGHT_UNITS, "cuda_graph": GRAPH_UNITS, "kv_cache": pool - WEIGHT_UNITS - GRAPH_UNITS}
        if self.sizes["kv_cache"] <= 0:
            raise RuntimeError("CUDA out of memory: no room for a KV cache")
        GPU.engine += pool
        self.released, self.session, self.running, self.dead = set(), False, 0, False
        self.weights = None  # load_format="dummy"
        self.backup = None
        self.loaded_by_worker = []  # per update: per worker, the names it read

    def _configure_process(self, kwargs):
        os.environ["NCCL_CUMEM_ENABLE"] = "0"
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
        os.environ["SGLANG_RUN_ID"] = f"sglang-run-{random.random()}"
        if kwargs.get("enable_deterministic_inference") and kwargs["tp_size"] > 1:
            os.environ["NCCL_ALGO"] = "allreduce:tree"
            os.environ["NCCL_MIN_NCHANNELS"] = os.environ["NCCL_MAX_NCHANNELS"] = "1"
        signal.signal(signal.SIGQUIT, lambda signum, frame: None)
        logging.basicConfig(level=logging.ERROR, format="[sglang] %(message)s", force=True)
        multiprocessing.set_start_method("spawn", force=True)
        gc.set_threshold(50_000, 50, 50)
        self.calls[0][1]["environ_seen"] = dict(os.environ)

    def _alive(self):
        assert not self.dead, "SGLang's scheduler died (a release while requests were running)"

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 return_routed_experts=False):
        self._alive()
        assert prompt is None and not self.released, "token ids in; memory resumed"
        outs = [self._one(ids, sp, return_logprob) for ids, sp in zip(input_ids, sampling_params)]
        weights = None if self.weights is None else checksum(self.weights)
        if return_routed_experts and self.kwargs.get("enable_return_routed_experts"):
            model = self._routing_model(weights)
            for ids, out in zip(input_ids, outs):
                routed = routed_experts(model, list(ids) + out["output_ids"])
                out["meta_info"]["routed_experts"] = base64.b64encode(routed.tobytes()).decode("utf-8")
        self.calls.append(("generate", {"input_ids": input_ids, "sampling_params": sampling_params,
                                        "return_logprob": return_logprob, "weights": weights,
                                        "return_routed_experts": return_routed_experts}, outs))
        return outs

    def _routing_model(self, weights_checksum):
        """``transformers``' model of ``model_path``'s config.json with the weights held, built once per weights."""
        if getattr(self, "_routing", (object(),))[0] != weights_checksum:
            self._routing = (weights_checksum, hf_model(self.kwargs["model_path"], self.weights))
        return self._routing[1]

    @staticmethod
    def _one(ids, sp, return_logprob):
        rng = random.Random(sp["sampling_seed"] * 1_000_003 + sum(ids))
        out, reason = [], {"type": "length", "length": sp["max_new_tokens"]}
        for _ in range(sp["max_new_tokens"]):
            out.append(rng.randrange(8))  # small ids: eos 3 and stop 5 come up often
            if not sp["ignore_eos"] and out[-1] in (sp["stop_token_ids"] or ()):
                reason = {"type": "stop", "matched": out[-1]}
                break
        meta = {"id": f"req-{rng.random()}", "finish_reason": reason, "prompt_tokens": len(ids)}
        if return_logprob:
            meta["output_token_logprobs"] = [(-0.1 - rng.random(), t, None) for t in out]
            meta["output_token_logprobs_length"] = len(out)
        return {"output_ids": out, "meta_info": meta}

    def begin_weight_update(self, selector="all"):
        self._alive()
        self.calls.append(("begin_weight_update", {}))
        ok = not self.session and "weights" not in self.released
        self.session = True
        return ok, "Success" if ok else "a weight-update session is already open"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._alive()
        by_worker = [[(n, t.get(w).clone()) for n, t in named_tensors] for w in range(self.tp)]
        for worker in by_worker[1:]:  # every worker got the same tensors from its own payload
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(by_worker[0], worker))
        self.loaded_by_worker.append([[n for n, _ in w] for w in by_worker])
        self.calls.append(("update_weights_from_tensor", {
            "named_tensors": by_worker[0], "load_format": load_format, "flush_cache": flush_cache,
            "payloads": [len(t.values) for _, t in named_tensors]}))
        if self.session:
            self.weights = dict(self.weights or {}) | dict(by_worker[0])
        return self.session, "Success" if self.session else "must run between begin and end_weight_update"

    def end_weight_update(self):
        self._alive()
        self.calls.append(("end_weight_update", {}))
        ok, self.session = self.session, False
        return ok, "Success" if ok else "no weight-update session is open"

    def flush_cache(self):
        self._alive()
        self.calls.append(("flush_cache", {}))
        if self.running:
            return SimpleNamespace(success=False, message=f"{self.running} requests are running")
        return SimpleNamespace(success=True, message="")

    def release_memory_occupation(self, tags=None):
        self._alive()
        if self.running:
            self.dead = True
            raise AssertionError("release_memory_occupation should be called only when server is idle.")
        assert not self.released & set(tags)
        self.released.update(tags)
        self.calls.append(("release_memory_occupation", {"tags": tags}))
        if not self.kwargs["enable_memory_saver"]:  # the no-op memory saver: nothing freed, values kept
            return
        GPU.engine -= sum(self.sizes[t] for t in tags)
        if "weights" in tags:
            self.backup = self.weights if self.kwargs.get("enable_weights_cpu_backup") else None
            self.weights = None

    def resume_memory_occupation(self, tags=None):
        self._alive()
        if not set(tags) <= self.released:  # SGLang: offload_tags.remove(tag) raises
            raise KeyError(f"not released: {set(tags) - self.released}")
        need = sum(self.sizes[t] for t in tags) if self.kwargs["enable_memory_saver"] else 0
        if need > GPU.free():
            raise RuntimeError(f"CUDA out of memory: resuming {tags} needs {need}, {GPU.free()} free")
        GPU.engine += need
        self.released.difference_update(tags)
        if "weights" in tags and self.kwargs["enable_memory_saver"]:
            self.weights = self.backup  # None without a CPU backup: the values are gone
        self.calls.append(("resume_memory_occupation", {"tags": tags}))

    def shutdown(self):
        self.calls.append(("shutdown", {}))


class FailingOnceFakeEngine(FakeEngine):
    """Its first ``update_weights_from_tensor`` fails (as SGLang answers a load error)."""

    failed = False

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        ok, message = super().update_weights_from_tensor(named_tensors, load_format, flush_cache)
        if not self.failed:
            self.failed = True
            return False, "load_weights failed"
        return ok, message


class SlowFakeEngine(FakeEngine):
    """Takes longer to start than the collective timeout of the start-timeout test."""

    delay_s = 6.0

"""Rollout routing replay (actor.router_replay=r3) with rollout.engine=sglang, against the fake engine, CPU fp32.

SGLang 0.5.23 returns each token's experts when started with ``enable_return_routed_experts`` and asked
per request with ``return_routed_experts``: ``meta_info["routed_experts"]``, base64 int32
(P + R - 1, layers, k). The fake (tests/sglang_fake.py) answers so, with the top-k of ``transformers``'
routers over prompt + response under the weights it was streamed (bfloat16, SGLang's dtype).

1. The adapter on a tiny random Qwen3-MoE, Mixtral and Qwen2-MoE (2 layers, 4 experts, top-2; Qwen2-MoE's shared
   expert is not among the returned ids, as SGLang cuts a fused shared expert's columns), at TP1 and at TP2 (sequence
   parallelism; only TP rank 0 holds an engine, the other gets the results by broadcast): 4 prompts
   (one of a single token) x 2 samples, stops and length limits both reached. Each result's
   ``prompt_expert_ids`` (P - 1, 2, 2) and ``expert_ids`` (R, 2, 2), uint8, equal the HF router's top-k
   of the checkpoint rounded to bfloat16 on prompt + response (rows 0 .. P - 2, then P - 1 .. P + R - 2),
   the same on both TP ranks. SGLang starts with the flag and each call asks for the ids; an engine
   started without the flag returns none (every result None); without record_experts nothing is asked.
2. parse_experts: uint8 below 256 experts, int16 from 256; a wrong row count, an id out of range, or a
   call where some results have ids and others not, each a one-line error naming the request.
3. launch/ppo.py on yaml/tiny_moe.yaml (EP2, 2 ranks, each its own fake) with rollout.engine=sglang, r3,
   one step, from the shipped checkpoint rounded to bfloat16 (so the fake's bfloat16 weights are the
   actor's fp32 ones): the dumped batch holds the HF router's ids on every position but each row's last,
   and the fp32 training router agrees with them on every choice (r3/agreement = 1, with and without
   replay, per layer too); so too with trainer.mode=async (SGLang on 2 rollout ranks, the ids sent to the
   2 training ranks). Started without the flag, the same run exits with require_expert_ids' one line.
Not covered: a real SGLang (its capture, kernels and bf16 routing; GPU only), partial rollouts
(refused with SGLang).
"""
import base64
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dist_helpers import spawn
from test_moe_r3_runs import FAST
from test_rollout_moe import hf_experts
from test_trainer_runs import ROOT, metrics

ARCHS = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"]  # Qwen2-MoE: a shared expert too
EOS = 3
PROMPTS = [[7, 8, 9, 10], [13], [20, 21, 22, 23, 24, 25], [30, 31]]
LIMITS = [6, 3, 8, 5]


def _requests():
    from megarl.rollout.engine import Request

    return [Request(10 + 2 * i + j, PROMPTS[i], 100 * i + j, LIMITS[i]) for i in range(4) for j in range(2)]


def _without_flag(**kwargs):
    """SGLang started without its routed-experts capture."""
    from sglang_fake import FakeEngine

    return FakeEngine(**{**kwargs, "enable_return_routed_experts": False})


def _job(rank, ckpt, tp):
    from megarl.distributed import init_distributed
    from megarl.rollout.engine import SamplingParams
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions
    from sglang_fake import FakeEngine, FakeSerialized
    from test_moe_r3_tp import _actor

    init_distributed()
    actor, groups, _ = _actor(ckpt, tp, 1, None)
    out = {}
    cases = (("r3", True, FakeEngine), ("no_flag", True, _without_flag), ("off", False, FakeEngine))
    for name, record, factory in cases:
        options = SGLangOptions(model_path=ckpt, record_experts=record)
        engine = SGLangEngine(actor.module, groups, actor.info, [EOS], options, engine_factory=factory,
                              tensor_wrapper=FakeSerialized)
        results = engine.generate(_requests(), SamplingParams(temperature=1.0))
        calls = engine.engine.calls if engine.engine is not None else []
        out[name] = {"results": results, "flag": [c[1]["enable_return_routed_experts"] for c in calls[:1]],
                     "asked": [c[1]["return_routed_experts"] for c in calls if c[0] == "generate"],
                     "keys": [["routed_experts" in o["meta_info"] for o in c[2]] for c in calls if c[0] == "generate"]}
        engine.close()
    return pickle.dumps(out)


@pytest.fixture(scope="module", params=ARCHS)
def moe_ckpt(request, tmp_path_factory):
    """A tiny random MoE checkpoint (fp32) and its HF model with every weight rounded to bfloat16."""
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp(request.param))
    model = make_tiny_checkpoint(path, request.param, seed=70)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return path, model


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(request, moe_ckpt):
    return request.param, [pickle.loads(r) for r in spawn(_job, request.param, moe_ckpt[0], request.param)]


def test_recorded_ids_are_the_routers_top_k(run, moe_ckpt):
    tp, ranks = run
    model = moe_ckpt[1]
    results = ranks[0]["r3"]["results"]
    assert [r.key for r in results] == [r.key for r in _requests()]
    assert {r.finish_reason for r in results} == {"stop", "length"}
    for r in results:
        with torch.no_grad():
            want = hf_experts(model, r.prompt_ids, r.response_ids).numpy()  # (P + R - 1, 2, 2)
        p = len(r.prompt_ids)
        assert r.prompt_expert_ids.dtype == np.uint8 and r.expert_ids.dtype == np.uint8
        assert r.prompt_expert_ids.shape == (p - 1, 2, 2) and r.expert_ids.shape == (len(r.response_ids), 2, 2)
        assert np.array_equal(r.prompt_expert_ids, want[:p - 1]) and np.array_equal(r.expert_ids, want[p - 1:])
    for other in ranks[1:]:  # TP rank 1 got TP rank 0's results by broadcast
        for a, b in zip(results, other["r3"]["results"], strict=True):
            assert a.response_ids == b.response_ids and np.array_equal(a.expert_ids, b.expert_ids)
            assert np.array_equal(a.prompt_expert_ids, b.prompt_expert_ids)
    assert ranks[0]["r3"]["flag"] == [True] and ranks[0]["r3"]["asked"] == [True]
    assert all(r["r3"]["flag"] == [] for r in ranks[1:])  # no engine on TP rank 1


def test_no_ids_without_the_flag_or_without_recording(run):
    _, ranks = run
    for name, flag, asked in (("no_flag", False, True), ("off", False, False)):
        got = ranks[0][name]
        assert (got["flag"], got["asked"], got["keys"]) == ([flag], [asked], [[False] * 8])
        for rank in ranks:
            assert all(r.expert_ids is None and r.prompt_expert_ids is None for r in rank[name]["results"])


def _encoded(ids):
    return {"meta_info": {"routed_experts": base64.b64encode(np.asarray(ids, np.int32).tobytes()).decode()}}


def test_parse_experts():
    from megarl.rollout.sglang import parse_experts

    info = SimpleNamespace(num_layers=2, moe=SimpleNamespace(topk=2, num_experts=8))
    ids = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 8  # P = 3, R = 3: 5 rows
    prompt, response = parse_experts(_encoded(ids), 0, 3, 3, info)
    assert prompt.dtype == response.dtype == np.uint8
    assert np.array_equal(prompt, ids[:2]) and np.array_equal(response, ids[2:])
    assert parse_experts({"meta_info": {}}, 0, 3, 3, info) is None
    wide = SimpleNamespace(num_layers=2, moe=SimpleNamespace(topk=2, num_experts=300))
    prompt, response = parse_experts(_encoded(ids + 250), 0, 3, 3, wide)
    assert response.dtype == np.int16 and int(response.max()) == 257
    with pytest.raises(RuntimeError, match=r"^SGLang request 4: routed_experts hold 20 ids, not 4 rows \(P \+ R - 1 "
                                           r"= 3 \+ 2 - 1\) of \(2 layers, top-2\)$"):
        parse_experts(_encoded(ids), 4, 3, 2, info)
    with pytest.raises(RuntimeError, match=r"^SGLang request 1: routed_experts hold ids outside 0 \.\. 7$"):
        parse_experts(_encoded(ids + 1), 1, 3, 3, info)


def test_some_results_without_ids_is_an_error(moe_ckpt):
    from megarl.models.hf_config import read_hf_config
    from megarl.rollout.engine import SamplingParams
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions
    from sglang_fake import FakeEngine, FakeSerialized

    class OneWithout(FakeEngine):
        def generate(self, **kwargs):
            outs = super().generate(**kwargs)
            del outs[1]["meta_info"]["routed_experts"]
            return outs

    groups = SimpleNamespace(pp_size=1, cp_size=1, tp_size=1, tp_rank=0, tp_src_rank=0)
    info = read_hf_config(moe_ckpt[0])
    engine = SGLangEngine(None, groups, info, [EOS], SGLangOptions(model_path=moe_ckpt[0], record_experts=True),
                          engine_factory=OneWithout, tensor_wrapper=FakeSerialized)
    engine.load_weights([])  # weights "pushed" (the fake keeps its dummy values)
    with pytest.raises(RuntimeError, match="^SGLang request 1: no routed_experts in its result "
                                           "while other requests of the call have them$"):
        engine.generate(_requests()[:3], SamplingParams())
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError, match="mixture-of-experts model only; set actor.router_replay=none$"):
        SGLangEngine(None, groups, SimpleNamespace(moe=None), [EOS], SGLangOptions(model_path="x", record_experts=True),
                     engine_factory=FakeEngine)


# -- launch/ppo.py -------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_moe(tmp_path_factory):
    """The shipped tiny MoE checkpoint with every weight rounded to bfloat16 (stored as fp32), and its HF model."""
    import transformers
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny_moe_bf16")
    src = Path(ROOT) / "megarl/assets/tiny_moe/sft"
    for name in os.listdir(src):
        shutil.copy(src / name, path)
    weights = load_file(str(src / "model.safetensors"))
    save_file({n: t.bfloat16().float() for n, t in weights.items()}, str(path / "model.safetensors"))
    return str(path), transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _sglang_ppo(tmp_path, name, model_path, *env, nproc=2, overrides=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "tests/sglang_fake_launch.py",
           "yaml/tiny_moe.yaml", f"trainer.run_dir={tmp_path / name}", "trainer.steps=1", *FAST,
           f"model.path={model_path}", "rollout.engine=sglang", "actor.router_replay=r3",
           f"trainer.dump_rollouts={tmp_path / name / 'dumps'}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MEGARL_TEST_SGLANG_LOG=str(tmp_path / f"{name}.log"), **dict(env))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_r3_run_on_sglang(tmp_path, bf16_moe):
    path, model = bf16_moe
    out = _sglang_ppo(tmp_path, "r3", path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for dp in (0, 1):
        d = torch.load(tmp_path / "r3" / "dumps" / f"step_000001_dp{dp}.pt", weights_only=False)
        ids, lengths = d["expert_ids"], d["lengths"]
        assert ids.dtype == torch.uint8 and ids.shape == (*d["input_ids"].shape, 4, 2)
        for row in range(len(lengths)):
            n = int(lengths[row])
            tokens = d["input_ids"][row, :n].tolist()
            with torch.no_grad():
                want = hf_experts(model, tokens[:1], tokens[1:])  # (n - 1, 4, 2): every position but the last
            assert torch.equal(ids[row, :n - 1].long(), want) and bool((ids[row, n - 1:] == 255).all())
    m = metrics(tmp_path / "r3")[1]
    for prefix in ("r3", "r3/no_replay"):
        assert m[f"{prefix}/agreement"] == 1.0 and m[f"{prefix}/agreement/layer_3"] == 1.0


def test_r3_run_without_the_flag_fails_in_one_line(tmp_path, bf16_moe):
    out = _sglang_ppo(tmp_path, "bare", bf16_moe[0], ("MEGARL_TEST_SGLANG_NO_EXPERTS", "1"))
    assert out.returncode != 0
    lines = [x for x in (out.stdout + out.stderr).splitlines() if "holds no recorded expert ids" in x]
    assert lines and "SGLang that returned none" in lines[0] and "actor.router_replay=none" in lines[0]


def test_r3_async_run_on_sglang(tmp_path, bf16_moe):
    """trainer.mode=async: the rollout ranks' SGLang records, the ids travel to the training ranks (EP2)."""
    out = _sglang_ppo(tmp_path, "async", bf16_moe[0], nproc=4, overrides=(
        "trainer.mode=async", "placement.rollout_ranks=2", "async.max_staleness=0", "data.eval_path="))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = metrics(tmp_path / "async")[1]
    for prefix in ("r3", "r3/no_replay"):
        assert m[f"{prefix}/agreement"] == 1.0 and m[f"{prefix}/agreement/layer_3"] == 1.0

"""``launch/convert.py``: HF -> megatron-core distributed checkpoint -> HF, bitwise.

A tiny random Qwen2ForCausalLM (QKV bias, tied embeddings, vocab 300 padded
to 512 at TP2) goes HF -> mcore at TP2 -> HF at TP2, and the same mcore
checkpoint -> HF at TP1 in one process (another layout, whose padded vocab
is 384: megatron-core loads the overlapping rows). Conversion only moves and
reshapes bytes, so every exported tensor equals the source bitwise (names,
dtypes, values) and config.json is unchanged. Each run is a real
``torchrun --nproc_per_node 2`` subprocess. Bad input (missing directory, no
config.json, unsupported architecture, no safetensors) exits 2 with one
stderr line and no traceback.

Not covered: bf16 conversion, PP layouts through the script (the loader and
exporter cover PP in test_models_parity.py), value models.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "convert.py")


def torchrun(*args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), SCRIPT, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def convert(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def read_hf_dir(path):
    """Tensors (single file, or the files an index lists) and config.json of a HF directory."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    tensors = {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}
    return tensors, json.load(open(os.path.join(path, "config.json")))


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("convert")
    src, ckpt = str(root / "hf"), str(root / "mcore")
    make_tiny_checkpoint(src, "Qwen2ForCausalLM", seed=3)
    logs = [torchrun("hf-to-mcore", "--hf", src, "--out", ckpt, "--tp", "2"),
            torchrun("mcore-to-hf", "--ckpt", ckpt, "--out", str(root / "tp2"), "--tp", "2"),
            torchrun("mcore-to-hf", "--ckpt", ckpt, "--out", str(root / "tp1"), nproc=1)]
    (root / "logs.json").write_text(json.dumps([[d.stdout, d.stderr] for d in logs]))
    return root


def test_one_success_line_and_no_library_warnings(round_trip):
    logs = json.loads((round_trip / "logs.json").read_text())
    wants = ["megatron-core checkpoint (tp=2, pp=1, fp32)", "Hugging Face checkpoint (", "Hugging Face checkpoint ("]
    for (stdout, stderr), want in zip(logs, wants):
        lines = [line for line in stdout.splitlines() if line.startswith("convert.py: wrote")]
        assert len(lines) == 1 and want in lines[0], stdout  # rank 0 only
        assert "Warning" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("layout", ["tp2", "tp1"])
def test_round_trip_is_bitwise(round_trip, layout):
    src, src_config = read_hf_dir(round_trip / "hf")
    out, out_config = read_hf_dir(round_trip / layout)
    assert sorted(out) == sorted(src) and "lm_head.weight" not in out
    for name, t in src.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    assert out_config == src_config
    assert os.path.exists(round_trip / layout / "generation_config.json")  # copied from the source


def test_metadata_beside_checkpoint(round_trip):
    meta = json.load(open(round_trip / "mcore" / "megarl_model.json"))
    assert meta["arch"] == "Qwen2ForCausalLM" and meta["saved_tp"] == 2
    assert meta["hf_config"]["vocab_size"] == 300


def _bad_inputs(tmp_path):
    no_config = tmp_path / "empty"
    no_config.mkdir()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    llama = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=128, vocab_size=300)
    (no_weights / "config.json").write_text(json.dumps(llama))
    return {
        "does not exist": ["hf-to-mcore", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
        "no config.json": ["hf-to-mcore", "--hf", str(no_config), "--out", str(tmp_path / "o")],
        "not supported": ["hf-to-mcore", "--hf", str(gpt2), "--out", str(tmp_path / "o")],
        "safetensors": ["hf-to-mcore", "--hf", str(no_weights), "--out", str(tmp_path / "o")],
        "megarl_model.json": ["mcore-to-hf", "--ckpt", str(no_config), "--out", str(tmp_path / "o")],
        "not a multiple of --tp 2": ["hf-to-mcore", "--hf", str(no_weights), "--out", str(tmp_path / "o"), "--tp", "2"],
    }


def test_bad_input_exits_2_with_one_line(tmp_path):
    for needle, args in _bad_inputs(tmp_path).items():
        done = convert(*args)
        assert done.returncode == 2, (needle, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_help():
    done = convert("--help")
    assert done.returncode == 0 and "hf-to-mcore" in done.stdout


# -- a training checkpoint (checkpoints/step_N) to HF ------------------------------------------------

PPO = os.path.join(ROOT, "launch", "ppo.py")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two PPO steps (critic, LoRA rank 4, a large LR so the adapters move), a checkpoint and an
    export (trainer.export_every=1) after each step, then the usual final export RUN/hf."""
    run = tmp_path_factory.mktemp("lora_run")
    done = subprocess.run(
        [sys.executable, PPO, "yaml/tiny.yaml", "trainer.steps=2", "trainer.save_every=1", "trainer.export_every=1",
         "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2", "data.batch_size=8",
         "actor.mini_batch_size=32", "actor.micro_batch_size=16", "critic.micro_batch_size=16",
         "data.eval_path=null", f"trainer.run_dir={run}", "trainer.monitor_interval_s=0", "trainer.tensorboard=false"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return run


def test_training_checkpoint_exports_like_the_live_model(lora_run, tmp_path):
    """convert.py on step_000001 (and on the run directory: its newest step) writes the bytes the
    trainer's own export of that step wrote (LoRA merged into W), and no critic or value head."""
    meta = json.load(open(lora_run / "checkpoints" / "step_000001" / "actor" / "megarl_model.json"))
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "experts": False,
                            "targets": sorted(["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])}
    assert json.load(open(lora_run / "checkpoints" / "step_000001" / "critic" / "megarl_model.json"))["value_head"]
    for ckpt, live in ((lora_run / "checkpoints" / "step_000001", lora_run / "exports" / "step_000001"),
                       (lora_run, lora_run / "hf")):
        out = tmp_path / ckpt.name
        done = convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        got, config = read_hf_dir(out)
        want, want_config = read_hf_dir(live)
        assert sorted(got) == sorted(want) and not any("score" in k or "value" in k for k in got)
        assert all(torch.equal(got[k], want[k]) for k in got)
        assert config == want_config and config["architectures"] == ["Qwen2ForCausalLM"]
        assert os.path.isfile(out / "tokenizer.json")
    base, _ = read_hf_dir(os.path.join(ROOT, "megarl", "assets", "tiny", "sft"))
    changed = [k for k in base if not torch.equal(base[k], got[k])]
    assert any("mlp.down_proj" in k for k in changed)  # the adapters' W + s B A, merged


def test_training_checkpoint_export_loads_in_transformers(lora_run, tmp_path):
    """The export of the newest checkpoint gives transformers the logits of the trainer's own export."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    assert convert("mcore-to-hf", "--ckpt", str(lora_run / "checkpoints"), "--out", str(out)).returncode == 0
    ids = torch.tensor([[5, 17, 33, 2, 9, 41, 7]])
    logits = [AutoModelForCausalLM.from_pretrained(str(p)).eval()(ids).logits
              for p in (out, lora_run / "hf", os.path.join(ROOT, "megarl", "assets", "tiny", "sft"))]
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])


def test_old_training_checkpoint_without_meta_is_one_line(lora_run, tmp_path):
    import shutil

    step = tmp_path / "step_000002"
    shutil.copytree(lora_run / "checkpoints" / "step_000002", step)
    os.remove(step / "actor" / "megarl_model.json")
    done = convert("mcore-to-hf", "--ckpt", str(step), "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"convert.py: error: '{step / 'actor'}' has no megarl_model.json (saved by an "
                                   "older megarl); pass --hf-config-from with the run's model.path to describe "
                                   "the model")
    tiny = os.path.join(ROOT, "megarl", "assets", "tiny", "sft")
    done = convert("mcore-to-hf", "--ckpt", str(step), "--out", str(tmp_path / "x"), "--hf-config-from", tiny)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"convert.py: error: '{step / 'actor'}' holds LoRA adapters but no "
                                   "megarl_model.json (saved by an older megarl), so their rank and scale are "
                                   "unknown; evaluate or export it with the megarl that saved it")


def test_meta_of_an_old_checkpoint_comes_from_hf_config_from(tmp_path):
    from megarl.models.hf_config import ModelInfo, read_hf_config
    from megarl.models.mcore_ckpt import load_training_meta

    tiny = os.path.join(ROOT, "megarl", "assets", "tiny", "sft")
    meta = load_training_meta(str(tmp_path), tiny)
    assert meta["lora"] is None and meta["source"] == tiny and meta["params_dtype"] == "fp32"
    assert ModelInfo.from_json(meta) == read_hf_config(tiny)

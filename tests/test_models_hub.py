"""model.path as a hub id, resolved offline against a Hugging Face cache laid out by the test.

The cache is the layout huggingface_hub writes: ``models--org--name/refs/main``
holds a commit hash and ``snapshots/<hash>/`` the files. huggingface_hub reads
``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` when it is imported, so each case runs
in a fresh interpreter. Not covered: a real download (no network here).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from megarl.assets import asset_path

ROOT = Path(__file__).resolve().parents[1]
REV = "0123456789abcdef0123456789abcdef01234567"

RESOLVE = """
from megarl.cli import load_config
from megarl.config import Config
from megarl.config_checks import validate
from megarl.data.tokenizer import load_tokenizer
cfg = load_config(["yaml/tiny_grpo.yaml", "model.path=megarl-test/tiny-sft", "ref.path=megarl-test/tiny-sft",
                   "trainer.run_dir={run_dir}"], Config)
validate(cfg, 2)
print(cfg.model.path)
print(cfg.ref.path)
print(load_tokenizer(cfg.model.path)("12")["input_ids"])
"""


def lay_out_cache(cache: Path) -> Path:
    repo = cache / "models--megarl-test--tiny-sft"
    snapshot = repo / "snapshots" / REV
    shutil.copytree(asset_path("tiny/sft"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return snapshot


def run(code: str, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "HF_HOME": str(cache.parent / "home"), "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_hub_id_resolves_to_the_cached_snapshot(tmp_path):
    snapshot = lay_out_cache(tmp_path / "hub")
    p = run(RESOLVE.format(run_dir=tmp_path / "run"), tmp_path / "hub")
    assert p.returncode == 0, p.stderr[-3000:]
    model, ref, ids = p.stdout.strip().splitlines()[-3:]
    assert Path(model) == snapshot and Path(ref) == snapshot
    from transformers import AutoTokenizer

    assert ids == str(AutoTokenizer.from_pretrained(str(asset_path("tiny/sft")))("12")["input_ids"])


def test_a_local_directory_is_not_looked_up(tmp_path):
    from megarl.models.hub import looks_like_repo_id, resolve_model_path

    assert resolve_model_path(str(asset_path("tiny/sft")), "model.path") == str(asset_path("tiny/sft"))
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and looks_like_repo_id("org/name@v1.0")
    assert not looks_like_repo_id("./org/name") and not looks_like_repo_id("/abs/dir")
    assert not looks_like_repo_id("megarl/assets")  # exists here (run from the checkout)


def test_not_cached_offline_is_one_line_and_exit_2(tmp_path):
    lay_out_cache(tmp_path / "hub")
    p = run("", tmp_path / "hub", "launch/ppo.py", "yaml/tiny_grpo.yaml", "model.path=Qwen/Qwen2.5-0.5B-Instruct",
            f"trainer.run_dir={tmp_path / 'run'}")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        f"config error: model.path=Qwen/Qwen2.5-0.5B-Instruct: not a local directory and not in the Hugging Face "
        f"cache {tmp_path / 'hub'} (HF_HUB_OFFLINE=1); download it where there is network (hf download "
        f"Qwen/Qwen2.5-0.5B-Instruct) or point model.path at a local directory"]

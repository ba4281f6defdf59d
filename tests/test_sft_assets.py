"""The shipped SFT checkpoints are what their documented command writes.

Each shipped ``sft/`` directory holds the ``megarl_sft.json`` its run wrote
(megarl/trainer/sft_record.py). Its yaml, loaded today from the repository root,
must give the recorded recipe (every setting launch/sft.py reads, the world size,
the SHA-256 of the training file and the model's config.json), and the weights
must be the recorded ones. So a change to the yaml, the data or the init config
without regenerating the checkpoint fails here. Not covered (a 496-step run is
minutes on 2 cores): that today's code and library versions still give these
bits; the record names the torch and megatron-core versions that did, and
``torchrun --nproc_per_node 2 launch/sft.py YAML sft.out_dir=DIR`` with them
reproduced them bitwise when they were shipped.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import load_config
from megarl.config import Config
from megarl.trainer.sft_record import read_sft_record, recipe_differences, sft_recipe, weights_sha256

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [("yaml/tiny_sft.yaml", "megarl/assets/tiny/sft"), ("yaml/tiny_tools_sft.yaml", "megarl/assets/tiny_tools/sft")]


@pytest.mark.parametrize("yaml_path, asset", SHIPPED)
def test_shipped_checkpoint_matches_its_yaml(yaml_path, asset, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names paths as the documented command, run from the root, does
    record = read_sft_record(asset)
    recipe = sft_recipe(load_config([yaml_path], Config), record["recipe"]["world_size"])
    assert recipe_differences(record["recipe"], recipe) == []
    assert record["weights_sha256"] == weights_sha256(asset) and record["weights_sha256"]


def test_a_changed_setting_is_caught(monkeypatch):
    """The comparison above is not vacuous: one epoch more, or another data file, is another recipe."""
    monkeypatch.chdir(ROOT)
    record = read_sft_record("megarl/assets/tiny/sft")["recipe"]
    sha = record["inputs_sha256"]["megarl/assets/tiny/sft.jsonl"]
    cases = {"sft.epochs=9": ["sft.epochs: recorded 8, now 9"],
             "trainer.seed=1": ["trainer_seed: recorded 42, now 1"],
             "sft.train_path=megarl/assets/tiny/train.jsonl": [
                 f"inputs_sha256.megarl/assets/tiny/sft.jsonl: recorded {sha!r}, now '<absent>'",
                 "sft.train_path: recorded 'megarl/assets/tiny/sft.jsonl', now 'megarl/assets/tiny/train.jsonl'"]}
    for override, expected in cases.items():
        assert recipe_differences(record, sft_recipe(load_config(["yaml/tiny_sft.yaml", override], Config), 2)) == expected
    assert recipe_differences({"sft": {"epochs": 8}}, {"sft": {"epochs": 8, "new_key": 1}}) == []

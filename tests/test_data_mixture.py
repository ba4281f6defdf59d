"""Several training sets mixed by weight: exact shares, disjoint DP slices, exact resume."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from megarl.assets import asset_path
from megarl.config import Config, DataSource
from megarl.data.build import build_train_data
from megarl.data.mixture import MixtureSampler
from megarl.data.sampler import PromptSampler
from megarl.errors import DataError


def set_of(index: int, sizes: list[int]) -> int:
    bound = 0
    for i, n in enumerate(sizes):
        bound += n
        if index < bound:
            return i
    raise AssertionError(index)


def test_shares_follow_the_weights_within_one_sample():
    """After k samples set i has had w_i k of them within one (weighted round robin)."""
    sizes, weights = [7, 50, 3], [0.5, 0.3, 0.2]
    s = MixtureSampler(sizes, weights, batch_size=5, seed=3)
    taken = [0, 0, 0]
    for step in range(40):
        for idx in s.next_global():
            taken[set_of(idx, sizes)] += 1
        k = 5 * (step + 1)
        assert all(abs(t - w * k) < 1.0 for t, w in zip(taken, weights)), (step, taken)
    assert taken == s.taken == [100, 60, 40]


def test_each_set_cycles_through_a_permutation_per_epoch():
    """Set 0 (3 items) is drawn 100 times: every run of 3 in its own order is a permutation."""
    sizes = [3, 10]
    s = MixtureSampler(sizes, [1.0, 1.0], batch_size=4, seed=0)
    drawn = [i for _ in range(50) for i in s.next_global() if i < 3]
    assert len(drawn) == 100
    for e in range(33):
        assert sorted(drawn[3 * e:3 * e + 3]) == [0, 1, 2]
    assert drawn[:3] != drawn[3:6] or drawn[3:6] != drawn[6:9]  # epochs are shuffled differently


def test_dp_ranks_take_disjoint_slices_of_the_same_global_batch():
    sizes, weights = [20, 30], [2.0, 1.0]
    whole = MixtureSampler(sizes, weights, batch_size=6, seed=1)
    ranks = [MixtureSampler(sizes, weights, batch_size=3, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    for _ in range(10):
        assert next(ranks[0]) + next(ranks[1]) == whole.next_global()


def test_resume_continues_exactly_and_checks_the_sets():
    sizes, weights = [5, 8], [0.25, 0.75]
    a = MixtureSampler(sizes, weights, batch_size=4, seed=7)
    for _ in range(7):
        a.next_global()
    state = json.loads(json.dumps(a.state_dict()))  # as a checkpoint's state.json holds it
    b = MixtureSampler(sizes, weights, batch_size=4, seed=7)
    b.load_state_dict(state)
    assert [b.next_global() for _ in range(9)] == [a.next_global() for _ in range(9)]
    with pytest.raises(DataError, match=r"the checkpoint has weights \[0.25, 0.75\], this run \[0.5, 0.5\]"):
        MixtureSampler(sizes, [0.5, 0.5], batch_size=4, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match="the checkpoint's data position is of one training set"):
        b.load_state_dict(PromptSampler(13, 4).state_dict())
    with pytest.raises(DataError, match=r"the checkpoint's data position is of several training sets \(data.train_mix\)"):
        PromptSampler(13, 4).load_state_dict(state)


def test_bad_weights_are_one_line():
    with pytest.raises(DataError, match=r"weights \[1.0, 0.0\] must be > 0"):
        MixtureSampler([3, 3], [1.0, 0.0], batch_size=2)


def test_build_train_data_concatenates_the_mix(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(asset_path("tiny/tokenizer")))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"a{i}", "answer": str(i)}) + "\n" for i in range(4)))
    b.write_text("".join(json.dumps({"q": f"b{i}", "answer": str(i)}) + "\n" for i in range(6)))
    cfg = Config().data
    cfg.apply_chat_template, cfg.batch_size = False, 4
    cfg.train_mix = [DataSource(path=str(a), weight=1.0), DataSource(path=str(b), weight=3.0)]
    cfg.row_map = ""
    with pytest.raises(DataError, match="b.jsonl:1: row has neither"):
        build_train_data(cfg, tok, 0, 1)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"prompt": f"b{i}", "answer": str(i)}) + "\n"
                                              for i in range(6)))
    ds, sampler = build_train_data(cfg, tok, 0, 1)
    assert [it.prompt_text for it in ds.items] == [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(6)]
    assert [it.index for it in ds.items] == list(range(10))
    batch = sampler.next_batch(ds)
    assert sorted(t[0] for t in batch.prompt_texts) == ["a", "b", "b", "b"]
    cfg.train_mix = []
    cfg.train_path = str(a)
    ds, sampler = build_train_data(cfg, tok, 0, 1)
    assert isinstance(sampler, PromptSampler) and len(ds) == 4


def test_yaml_relative_paths_of_mix_and_eval_entries(tmp_path, monkeypatch):
    """An entry's relative path is read beside the yaml when the working directory lacks it (as
    data.train_path is); a hub name stays as written."""
    from megarl.cli import load_config

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "a.jsonl").write_text('{"prompt": "x"}\n')
    (project / "run.yaml").write_text(
        "data:\n  train_mix:\n    - {path: data/a.jsonl, weight: 2}\n    - {path: openai/gsm8k, subset: main}\n"
        "  eval_sets:\n    - {name: a, path: data/a.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["project/run.yaml"], Config)
    assert [s.path for s in cfg.data.train_mix] == ["project/data/a.jsonl", "openai/gsm8k"]
    assert cfg.data.train_mix[0].weight == 2.0 and cfg.data.eval_sets[0].path == "project/data/a.jsonl"

"""Prompt sources: saved `datasets`, hub names offline, column mapping (GSM8K- and MATH-shaped rows)."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megarl.assets import asset_path
from megarl.data import PromptDataConfig, load_prompt_dataset
from megarl.data.sources import Columns, source_kind
from megarl.errors import DataError, ExtensionError
from megarl.rewards import math_answer_reward

GSM8K = [{"question": "Tom has 3 apples and buys 39 more. How many?", "answer": "3 + 39 = 42\n#### 42"},
         {"question": "What is 1,000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"}]
MATH = [{"problem": "Simplify $\\frac{6}{8}$.", "solution": "Divide by 2: $\\boxed{\\frac{3}{4}}$.",
         "level": "Level 1"},
        {"problem": "Compute $\\{1\\}$.", "solution": "It is $\\boxed{\\{1, \\{2\\}\\}}$", "level": "Level 5"}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(asset_path("tiny/tokenizer")))


def load(path, tok, **kw):
    return load_prompt_dataset(PromptDataConfig(paths=[str(path)], apply_chat_template=False, **kw), tok)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_parquet_with_column_keys_and_its_reward(tmp_path, tok):
    p = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K), p)
    with pytest.raises(DataError, match=r"row has neither 'prompt' nor 'messages' \(its columns: question, answer\); "
                                        r"name the prompt column with data.prompt_key"):
        load(p, tok)
    ds = load(p, tok, columns=Columns(prompt_key="question", answer_key="answer"))
    assert [it.prompt_text for it in ds.items] == [r["question"] for r in GSM8K]
    assert [it.answer for it in ds.items] == [r["answer"] for r in GSM8K]
    assert ds[0].extra == {}
    # the ground truth is a whole solution: the reward compares its '#### ' answer
    assert math_answer_reward("so the total is 42.", ds[0].answer) == 1.0
    assert math_answer_reward("#### 1234", ds[1].answer) == 1.0
    assert math_answer_reward("#### 1233", ds[1].answer) == 0.0


def test_math_rows_solution_column_and_nested_boxed(tmp_path, tok):
    p = write_jsonl(tmp_path / "math.jsonl", MATH)
    ds = load(p, tok, columns=Columns(prompt_key="problem", answer_key="solution"))
    assert [it.answer for it in ds.items] == [r["solution"] for r in MATH]
    assert ds[1].extra == {"level": "Level 5"}
    assert math_answer_reward("so \\boxed{\\dfrac{3}{4}}", ds[0].answer) == 1.0
    assert math_answer_reward("\\boxed{\\{1, \\{2\\}\\}}", ds[1].answer) == 1.0
    assert math_answer_reward("\\boxed{\\{1\\}}", ds[1].answer) == 0.0


def test_missing_prompt_key_names_the_columns(tmp_path, tok):
    p = write_jsonl(tmp_path / "a.jsonl", GSM8K)
    with pytest.raises(DataError, match=r"a.jsonl:1: row has no 'problem' column \(data.prompt_key\); "
                                        r"its columns: question, answer$"):
        load(p, tok, columns=Columns(prompt_key="problem"))


def test_row_map_from_a_module_in_the_working_directory(tmp_path, tok, monkeypatch):
    (tmp_path / "my_rows.py").write_text(
        "def gsm8k(row):\n"
        "    return {'prompt': 'Q: ' + row['question'], 'answer': row['answer'].split('####')[-1].strip(),\n"
        "            'id': len(row['question'])}\n"
        "def bad(row):\n    return [row]\n")
    monkeypatch.chdir(tmp_path)
    from megarl.cli import add_import_dirs

    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    add_import_dirs(None)
    p = write_jsonl(tmp_path / "g.jsonl", GSM8K)
    ds = load(p, tok, columns=Columns(row_map="my_rows:gsm8k"))
    assert [it.prompt_text for it in ds.items] == ["Q: " + r["question"] for r in GSM8K]
    assert [it.answer for it in ds.items] == ["42", "1,234"]
    assert ds[0].extra == {"id": len(GSM8K[0]["question"])}
    with pytest.raises(ExtensionError, match=r"g.jsonl:1: data.row_map=my_rows:bad returned a list"):
        load(p, tok, columns=Columns(row_map="my_rows:bad"))
    with pytest.raises(DataError, match=r"data.row_map='nope_mod:f': cannot import module"):
        load(p, tok, columns=Columns(row_map="nope_mod:f"))


def test_saved_dataset_and_dataset_dict(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_list(GSM8K).save_to_disk(str(single))
    assert source_kind(str(single)) == "saved"
    ds = load(single, tok, columns=Columns(prompt_key="question"))
    assert [it.answer for it in ds.items] == [r["answer"] for r in GSM8K]
    assert ds[1].source == f"{single}:row 1"
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH),
                          "test": datasets.Dataset.from_list(MATH[:1])}).save_to_disk(str(both))
    cols = Columns(prompt_key="problem", answer_key="solution")
    assert len(load(both, tok, split="train", columns=cols)) == 2
    test = load(both, tok, split="test", columns=cols)
    assert [it.prompt_text for it in test.items] == [MATH[0]["problem"]] and test[0].source == f"{both}[test]:row 0"
    assert load(single, tok, split="train", columns=Columns(prompt_key="question"))[0].source == f"{single}:row 0"
    with pytest.raises(DataError, match=r"the saved dataset has splits \['test', 'train'\], not 'validation'"):
        load(both, tok, split="validation", columns=cols)


def test_hub_name_offline_is_one_line(tmp_path, tok, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert source_kind("someone/no-such-set") == "hub"
    with pytest.raises(DataError, match=r"^someone/no-such-set: not a local file or directory, and loading it as a "
                                        r"hub dataset failed \(.*\); check the name"):
        load("someone/no-such-set", tok, split="train")


@pytest.mark.parametrize("path, message", [
    ("missing.jsonl", "missing.jsonl: prompt data file not found"),
    ("./missing_dir", "./missing_dir: prompt data file not found"),
])
def test_missing_local_paths(path, message):
    with pytest.raises(DataError, match=message):
        source_kind(path)


def test_plain_directory_is_not_a_dataset(tmp_path):
    with pytest.raises(DataError, match="a directory but not a saved dataset"):
        source_kind(str(tmp_path))


def test_reward_module_beside_the_yaml_imports_from_another_directory(tmp_path):
    """A fresh interpreter started in the checkout (not in the yaml's directory, no PYTHONPATH entry for
    it) loads a yaml whose reward term lives beside it; config checks import it as every rank does."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "my_reward_beside.py").write_text(
        "def score(prompt, response, ground_truth, extra, bonus=0.0):\n    return len(response) + bonus\n")
    (conf / "run.yaml").write_text("reward:\n  terms:\n    - {name: 'my_reward_beside:score', kwargs: {bonus: 0.5}}\n")
    code = ("import sys\nfrom megarl.cli import load_config\nfrom megarl.config import Config\n"
            "from megarl.config_checks import check_reward\nfrom megarl.rewards import get_reward\n"
            f"cfg = load_config([{str(conf / 'run.yaml')!r}], Config)\ncheck_reward(cfg)\n"
            "print(get_reward(cfg.reward.terms[0].name)('p', 'abc', None, {}, **cfg.reward.terms[0].kwargs))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{root}:{root / 'kernels'}"}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3.5"

"""SFT rows through the prompt sets' sources: column mapping, saved and hub datasets, mixtures,
and one-line errors. CPU only, no process group (build_sft_data is plain Python)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.assets import asset_path
from megarl.cli import load_config
from megarl.config import Config
from megarl.config_checks import check_sft_data
from megarl.data.sft import build_sft_data
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
TINY_SFT = asset_path("tiny/sft.jsonl")
GSM8K = [{"question": "what is 12 + 30?", "answer": "12 + 30 = 42\n#### 42"},
         {"question": "what is 3 * 4?", "answer": "3 * 4 = 12\n#### 12"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(asset_path("tiny/init")))


def cfg_of(*overrides):
    return load_config([str(ROOT / "yaml" / "tiny_sft.yaml"), *overrides], Config)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected_ids(tok, prompt: str, response: str) -> tuple[list[int], int]:
    """Chat-templated prompt + response + eos, and the prompt's length (the loss starts there)."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    p = tok(text, add_special_tokens=False)["input_ids"]
    return p + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], len(p)


def test_default_rows_and_sampler_of_the_tiny_set(tok):
    """The shipped file: 4000 rows, all fit; 4000 // 64 = 62 steps per epoch x 8 epochs = 496 steps;
    DP rank r's indices are the r-th half of the one-set sampler's global batch."""
    data = build_sft_data(cfg_of(), tok, 1, 2)
    assert data.counts == {"rows": 4000, "too_long": 0} and data.steps == 496
    first = json.loads(Path(TINY_SFT).read_text().splitlines()[0])
    assert (data.rows[0].ids, data.rows[0].prompt_len) == expected_ids(tok, first["prompt"], first["response"])
    from megarl.data.sampler import PromptSampler
    assert next(data.sampler) == PromptSampler(4000, 32, 0, 1, 0).permutation(0)[32:64].tolist()


def test_gsm8k_parquet_with_prompt_and_response_keys(tmp_path, tok):
    """A GSM8K-shaped parquet: question -> prompt, answer (a column parse_row reads as the ground
    truth) -> the trained response."""
    p = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K), p)
    cfg = cfg_of(f"sft.train_path={p}", "sft.prompt_key=question", "sft.response_key=answer",
                 "sft.batch_size=2", "sft.max_len=64")
    data = build_sft_data(cfg, tok, 0, 1)
    assert [(r.ids, r.prompt_len) for r in data.rows] == [expected_ids(tok, g["question"], g["answer"]) for g in GSM8K]
    assert data.steps == 8  # 8 epochs of one step


def test_missing_response_column_is_one_line(tmp_path, tok):
    p = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "reverse 123", "output": "#### 321"}])
    with pytest.raises(DataError, match=r"q.jsonl:1: SFT row has no 'response' column \(sft.response_key; its columns "
                                        r"besides the prompt: output\); set sft.response_key"):
        build_sft_data(cfg_of(f"sft.train_path={p}", "sft.batch_size=1"), tok, 0, 1)
    q = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "reverse 123", "response": ["#### 321"]}])
    with pytest.raises(DataError, match=r"n.jsonl:1: SFT response 'response' is a list; it must be a string"):
        build_sft_data(cfg_of(f"sft.train_path={q}", "sft.batch_size=1"), tok, 0, 1)


def test_row_map_rewrites_rows(tmp_path, tok, monkeypatch):
    (tmp_path / "sft_rows_mod.py").write_text(
        "def to_row(r):\n    return {'prompt': r['q'], 'response': '#### ' + r['a']}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = write_jsonl(tmp_path / "qa.jsonl", [{"q": "reverse 12", "a": "21"}])
    data = build_sft_data(cfg_of(f"sft.train_path={p}", "sft.row_map=sft_rows_mod:to_row", "sft.batch_size=1"), tok, 0, 1)
    assert (data.rows[0].ids, data.rows[0].prompt_len) == expected_ids(tok, "reverse 12", "#### 21")


def test_saved_dataset_dict_split(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K),
                          "test": datasets.Dataset.from_list(GSM8K[:1])}).save_to_disk(str(d))
    base = [f"sft.train_path={d}", "sft.prompt_key=question", "sft.response_key=answer", "sft.batch_size=1"]
    assert len(build_sft_data(cfg_of(*base), tok, 0, 1).rows) == 2
    assert len(build_sft_data(cfg_of(*base, "sft.train_split=test"), tok, 0, 1).rows) == 1
    with pytest.raises(DataError, match=r"splits \['test', 'train'\], not 'dev'"):
        build_sft_data(cfg_of(*base, "sft.train_split=dev"), tok, 0, 1)


def test_hub_name_offline_is_one_line(tmp_path, tok, monkeypatch):
    pytest.importorskip("datasets")
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DataError, match=r"^someone/no-such-sft: not a local file or directory, and loading it as a "
                                        r"hub dataset failed"):
        build_sft_data(cfg_of("sft.train_path=someone/no-such-sft"), tok, 0, 1)


def test_mixture_draws_by_weight_with_per_set_columns(tmp_path, tok):
    """Two sets, weights 3:1, the second with its own column names. 40 + 8 rows, batch 8:
    48 // 8 = 6 steps per epoch; the weighted round robin gives exactly 6 of every 8 samples
    from the first set, and each set's rows come as its own rows."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"reverse {i + 10}", "response": f"#### {i}"} for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"q": f"copy {i + 10}", "out": f"#### {i + 10}"} for i in range(8)])
    mix = (f"sft.train_mix=[{{path: {a}, weight: 3}}, "
           f"{{path: {b}, weight: 1, prompt_key: q, response_key: out}}]")
    cfg = cfg_of(mix, "sft.batch_size=8", "sft.micro_batch_size=4", "sft.epochs=2")
    check_sft_data(cfg.sft)
    data = build_sft_data(cfg, tok, 0, 1)
    assert data.steps == 12 and data.counts == {"rows": 48, "too_long": 0}
    assert (data.rows[40].ids, data.rows[40].prompt_len) == expected_ids(tok, "copy 10", "#### 10")
    for _ in range(3):
        assert Counter(i >= 40 for i in next(data.sampler)) == {False: 6, True: 2}


def test_too_long_rows_are_counted(tmp_path, tok):
    """The prompt is 30 tokens; '#### 1' + eos is 7 more (37), '#### 12345' + eos 11 (41)."""
    p = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "reverse 123", "response": "#### 1"},
                                           {"prompt": "reverse 123", "response": "#### 12345"}])
    data = build_sft_data(cfg_of(f"sft.train_path={p}", "sft.batch_size=1", "sft.max_len=40"), tok, 0, 1)
    assert data.counts == {"rows": 2, "too_long": 1} and len(data.rows[0].ids) == 37
    with pytest.raises(DataError, match=r"l.jsonl: no SFT row fits sft.max_len=30 tokens \(2 rows\)"):
        build_sft_data(cfg_of(f"sft.train_path={p}", "sft.batch_size=1", "sft.max_len=30"), tok, 0, 1)


def test_mixture_smaller_than_a_batch(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "reverse 12", "response": "#### 21"}])
    with pytest.raises(DataError, match=r"sft.train_mix: 1 rows in all, fewer than one global batch of "
                                        r"sft.batch_size=4; lower it or add data"):
        build_sft_data(cfg_of(f"sft.train_mix=[{{path: {a}}}]", "sft.batch_size=4"), tok, 0, 1)


@pytest.mark.parametrize("override, message", [
    ("sft.train_path=nope.jsonl", "sft.train_path: 'nope.jsonl' not found; name a .jsonl"),
    ("sft.train_mix=[{path: nope.jsonl}]", "sft.train_mix[0].path: 'nope.jsonl' not found"),
    (f"sft.train_mix=[{{path: {TINY_SFT}, weight: 0}}]", "sft.train_mix[0].weight=0"),
    ("sft.response_key=", "sft.response_key is empty; name the column"),
    ("sft.row_map=no_such_mod_xyz:f", "sft.row_map='no_such_mod_xyz:f': "),
])
def test_config_errors_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        check_sft_data(cfg_of(override).sft)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_mix_paths_are_read_beside_the_yaml(tmp_path, monkeypatch):
    """A relative sft.train_mix path not found from the working directory is the yaml's neighbour."""
    write_jsonl(tmp_path / "rows_beside.jsonl", [{"prompt": "reverse 12", "response": "#### 21"}])
    (tmp_path / "run.yaml").write_text("sft:\n  train_mix:\n    - {path: rows_beside.jsonl, weight: 2}\n")
    monkeypatch.chdir(ROOT)
    cfg = load_config([str(tmp_path / "run.yaml")], Config)
    assert cfg.sft.train_mix[0].path == str(tmp_path / "rows_beside.jsonl")
    check_sft_data(cfg.sft)

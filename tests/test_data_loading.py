"""Prompt loading: JSONL/Parquet, malformed rows, chat templating, length filter."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megarl.errors import DataError
from megarl.assets import asset_path
from megarl.data import PromptDataConfig, load_prompt_dataset


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(asset_path("tiny/tokenizer")))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def load(paths, tok, **kw):
    return load_prompt_dataset(PromptDataConfig(paths=[str(p) for p in paths], **kw), tok)


def test_jsonl_fields_and_extra(tmp_path, tok):
    p = write_jsonl(tmp_path / "a.jsonl", [
        {"prompt": "1+2=?", "answer": "3", "extra": {"k": 1}, "level": "easy"},
        {"messages": [{"role": "user", "content": "2+2=?"}], "ground_truth": 4},
        "",  # blank line: not a row
        {"prompt": "x"},
    ])
    ds = load([p], tok)
    assert ds.counts == {"rows": 3, "malformed": 0, "too_long": 0, "kept": 3}
    assert [it.answer for it in ds.items] == ["3", "4", None]
    assert ds[0].extra == {"k": 1, "level": "easy"}
    assert ds[0].messages == [{"role": "user", "content": "1+2=?"}]
    assert [it.index for it in ds.items] == [0, 1, 2]
    assert ds[2].source == f"{p}:4"


def test_messages_need_template(tmp_path, tok):
    p = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=rf"{re.escape(str(p))}:1: row has 'messages' but chat templating is off"):
        load([p], tok, apply_chat_template=False)


def test_parquet(tmp_path, tok):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "1+2=?", "answer": "3", "src": "x"},
        {"prompt": "5+5=?", "answer": "10", "src": "y"},
    ]), p)
    ds = load([p], tok, apply_chat_template=False)
    assert [it.prompt_text for it in ds.items] == ["1+2=?", "5+5=?"]
    assert ds[1].extra == {"src": "y"} and ds[1].source == f"{p}:row 1"
    assert ds[0].prompt_ids == tok("1+2=?")["input_ids"]


def test_parquet_malformed_names_row(tmp_path, tok):
    p = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "x": 1}, {"prompt": None, "x": 2}]), p)
    with pytest.raises(ValueError, match=rf"{re.escape(str(p))}:row 1: row has neither 'prompt' nor 'messages'"):
        load([p], tok)


@pytest.mark.parametrize("line, message", [
    ('{"answer": "3"}', r"row has neither 'prompt' nor 'messages' \(its columns: answer\); name the prompt column with "
                         "data.prompt_key"),
    ('{"prompt": "a", "answer": "3"', "bad JSON"),
    ('{"prompt": 5}', "'prompt' is a int; it must be a string"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object"),
    ('{"prompt": "a", "extra": [1]}', "'extra' is a list"),
    ('{"prompt": "a", "answer": [1]}', "'answer' is a list"),
    ('[1, 2]', "row is a list, not an object"),
])
def test_malformed_names_file_line(tmp_path, tok, line, message):
    p = write_jsonl(tmp_path / "train.jsonl", ['{"prompt": "ok"}', "", line])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}:3: .*{message}"):
        load([p], tok)


def test_a_line_that_is_not_utf8_is_a_data_error_or_a_counted_skip(tmp_path, tok):
    from megarl.errors import DataError

    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n{"prompt": "ok2"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(p))}:2: not UTF-8 \(byte 0xff at column 13\); re-encode"):
        load([p], tok)
    assert load([p], tok, skip_malformed=True).counts["malformed"] == 1


def test_skip_malformed_counts(tmp_path, tok):
    p = write_jsonl(tmp_path / "c.jsonl", ['{"prompt": "ok"}', "{bad", '{"answer": 1}', '{"prompt": "ok2"}'])
    ds = load([p], tok, skip_malformed=True)
    assert ds.counts == {"rows": 4, "malformed": 2, "too_long": 0, "kept": 2}
    assert [it.messages[0]["content"] for it in ds.items] == ["ok", "ok2"]


def test_chat_template_applied(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12+7=?"}])
    ds = load([p], tok, system_prompt="add")
    want = ("<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n12+7=?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert ds[0].prompt_text == want
    assert ds[0].prompt_ids == tok(want, add_special_tokens=False)["input_ids"]
    assert ds[0].prompt_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_overlong_filtered_and_counted(tmp_path, tok):
    p = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "1" * n} for n in (3, 8, 9, 2)])
    ds = load([p], tok, apply_chat_template=False, max_prompt_len=8)
    assert ds.counts == {"rows": 4, "malformed": 0, "too_long": 1, "kept": 3}
    assert [len(it.prompt_ids) for it in ds.items] == [3, 8, 2]
    assert [it.index for it in ds.items] == [0, 1, 2]


@pytest.mark.parametrize("rows,hint", [
    ([{"prompt": "1" * 9}], "longer than data.max_prompt_len=8: raise it"),
    ([], "the files hold no rows"),
    ([{"no_prompt": "x"}, "not json"], "every row was skipped"),
])
def test_empty_dataset_hint_names_the_cause(tmp_path, tok, rows, hint):
    p = tmp_path / "f.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    with pytest.raises(DataError, match="no prompts left") as err:
        load([str(p)], tok, apply_chat_template=False, max_prompt_len=8, skip_malformed=True)
    assert hint in str(err.value)
    assert ("max_prompt_len" in str(err.value).split(";")[-1]) == ("longer" in hint)


def test_two_files_concatenate(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b"}, {"prompt": "c"}])
    ds = load([a, b], tok, apply_chat_template=False)
    assert [it.prompt_text for it in ds.items] == ["a", "b", "c"]
    assert ds.batch([2, 0]).prompt_texts == ["c", "a"]


def test_config_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="data.paths is empty"):
        load([], tok)
    with pytest.raises(DataError, match="nope.jsonl: prompt data file not found"):
        load([tmp_path / "nope.jsonl"], tok)


def test_from_run_config_section(tok):
    """The run config's data section (megarl.config.DataConfig) maps onto the loader options."""
    from megarl.config import DataConfig

    data = DataConfig()
    cfg = PromptDataConfig.from_section(data, str(asset_path("tiny/test.jsonl")))
    ds = load_prompt_dataset(cfg, tok)
    assert ds.counts == {"rows": 200, "malformed": 0, "too_long": 0, "kept": 200}
    assert max(len(it.prompt_ids) for it in ds.items) <= data.max_prompt_len


def test_corrupt_parquet_is_a_data_error(tmp_path, tok):
    p = tmp_path / "broken.parquet"
    p.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(DataError, match=r"broken.parquet: not a readable Parquet file .*rewrite it or use .jsonl"):
        load([str(p)], tok)

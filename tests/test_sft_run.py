"""launch/sft.py end to end on one process: a two-set mixture with its own columns trains and
exports, the export records its recipe and weights (megarl_sft.json), a rerun gives the same bits,
and a row without the response column is one line and exit 2. Not covered here: DP > 1 (the
sampler's DP slices are tested in tests/test_sft_data.py and tests/test_data_mixture.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.cli import load_config
from megarl.config import Config
from megarl.trainer.sft_record import read_sft_record, sft_recipe, weights_sha256

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def sft(*overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "launch/sft.py", "yaml/tiny_sft.yaml", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_mixture_run_records_recipe_and_reruns_bitwise(tmp_path):
    qa = [{"question": f"reverse {100 + 7 * i}", "solution": f"#### {str(100 + 7 * i)[::-1]}"} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(qa), tmp_path / "qa.parquet")
    lines = (ROOT / "megarl/assets/tiny/sft.jsonl").read_text().splitlines(keepends=True)[:48]
    (tmp_path / "tiny.jsonl").write_text("".join(lines))
    mix = (f"sft.train_mix=[{{path: {tmp_path / 'tiny.jsonl'}, weight: 3}}, "
           f"{{path: {tmp_path / 'qa.parquet'}, weight: 1, prompt_key: question, response_key: solution}}]")
    args = [mix, "sft.batch_size=8", "sft.micro_batch_size=4", "sft.epochs=1", "sft.optim.warmup_steps=1"]
    outs = []
    for run in ("a", "b"):
        out = tmp_path / run
        p = sft(*args, f"sft.out_dir={out}")
        assert p.returncode == 0, p.stderr[-2000:]
        assert "sft rows: 64 (0 longer than sft.max_len skipped)" in p.stdout
        assert "sft step 8/8" in p.stdout  # 64 // 8
        outs.append(out)
    record = read_sft_record(outs[0])
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        expected = sft_recipe(load_config(["yaml/tiny_sft.yaml", *args], Config), 1)
    finally:
        os.chdir(cwd)
    assert record["recipe"] == json.loads(json.dumps(expected))
    assert record["steps"] == 8 and 0 < record["final_nll"] < 5
    assert record["weights_sha256"] == weights_sha256(outs[0]) == weights_sha256(outs[1])
    assert set(record["recipe"]["inputs_sha256"]) == {str(tmp_path / "tiny.jsonl"), str(tmp_path / "qa.parquet"),
                                                      "megarl/assets/tiny/init/config.json"}


def test_missing_response_column_is_one_line_exit_2(tmp_path):
    p = sft("sft.response_key=output", f"sft.out_dir={tmp_path / 'out'}")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "data error: megarl/assets/tiny/sft.jsonl:1: SFT row has no 'output' column (sft.response_key; its "
        "columns besides the prompt: response); set sft.response_key to the response column or map rows with "
        "sft.row_map"]
    assert not (tmp_path / "out").exists()

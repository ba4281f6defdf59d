"""Config loading (megarl.cli) and cross-field checks (megarl.config_checks), in process.

Every user mistake must come back as one ConfigError line that names the key
(and, for a misspelt key, the nearest real one). Not covered here: what the
entry scripts print and their exit codes (tests/test_entry.py).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from pathlib import Path

import pytest

from megarl.errors import ConfigError
from megarl.cli import build, help_text, load_config, parse_override
from megarl.config import Config, OptimConfig
from megarl.config_checks import validate, validate_sft

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "yaml" / "tiny.yaml")


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    """Default paths (megarl/assets/tiny/...) are relative to the checkout."""
    monkeypatch.chdir(ROOT)


def error_of(argv, cls=Config) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv, cls)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def check_error(overrides, world_size=2, base=(TINY,), check=validate) -> str:
    cfg = load_config([*base, *overrides], Config)
    with pytest.raises(ConfigError) as e:
        check(cfg, world_size)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# --- loading: keys, types, choices ------------------------------------------

@pytest.mark.parametrize("argv, suggestion", [
    (["actor.optim.lrr=1"], "did you mean 'lr'"),
    (["trainer.stepz=3"], "did you mean 'steps'"),
    (["rollout.temprature=0.5"], "did you mean 'temperature'"),
    (["reward.terms=[{name: math, wieght: 1}]"], "did you mean 'weight'"),
])
def test_unknown_key_suggests_nearest(argv, suggestion):
    msg = error_of(argv)
    assert msg.startswith("unknown key '") and suggestion in msg


def test_unknown_section_lists_sections():
    msg = error_of(["foo=1"])
    assert "unknown key 'foo'" in msg and "actor" in msg and "trainer" in msg


@pytest.mark.parametrize("argv, key, expected", [
    (["actor.optim.lr=fast"], "actor.optim.lr", "expected float"),
    (["trainer.steps=1.5"], "trainer.steps", "expected int"),
    (["trainer.steps=true"], "trainer.steps", "expected int"),
    (["parallel.sequence_parallel=3"], "parallel.sequence_parallel", "expected bool"),
    (["rollout.stop_token_ids=[1, x]"], "rollout.stop_token_ids[1]", "expected int"),
    (["actor.optim.betas=0.9"], "actor.optim.betas", "expected a list"),
    (["critic.optim=5"], "critic.optim", "expected a mapping"),
])
def test_wrong_type_names_key_and_type(argv, key, expected):
    msg = error_of(argv)
    assert msg.startswith(f"{key}:") and expected in msg


def test_literal_choices_listed():
    msg = error_of(["model.dtype=fp8"])
    assert msg.startswith("model.dtype:") and "float32, bfloat16, float16" in msg
    assert load_config(["model.dtype=bfloat16"], Config).model.dtype == "bfloat16"
    assert "is not one of native" in error_of(["rollout.engine=vllm"])


def test_scalar_coercions():
    cfg = load_config(["actor.optim.lr=3e-4", "actor.optim.eps=1", "model.tokenizer=null"], Config)
    assert cfg.actor.optim.lr == 3e-4 and isinstance(cfg.actor.optim.eps, float)
    assert cfg.model.tokenizer is None


def test_override_needs_equals_sign():
    with pytest.raises(ConfigError, match="not key=value"):
        load_config([TINY, "trainer.steps"], Config)
    assert parse_override("data.eval_path=") == ("data.eval_path", "")


# --- nesting and layering ---------------------------------------------------

def test_nested_override_keeps_section_defaults():
    cfg = load_config(["critic.optim.warmup_steps=3"], Config)
    assert cfg.critic.optim.warmup_steps == 3
    assert cfg.critic.optim.lr == 1e-5  # CriticConfig's own default, not OptimConfig's 1e-6
    assert cfg.actor.optim == OptimConfig()
    sft = load_config(["sft.optim.lr=0.5"], Config).sft.optim
    assert (sft.lr, sft.warmup_steps, sft.decay) == (0.5, 10, "cosine")


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("critic:\n  optim:\n    lr: 0.002\ntrainer:\n  steps: 7\n")
    cfg = load_config([str(path), "critic.optim.warmup_steps=3", "trainer.steps=9"], Config)
    assert (cfg.critic.optim.lr, cfg.critic.optim.warmup_steps) == (0.002, 3)
    assert cfg.trainer.steps == 9  # the command line wins over the file
    assert cfg.trainer.run_dir == "runs/run"  # the yaml's name: no run of another config shares it


def test_repo_yaml_files_load():
    for name in ("tiny", "tiny_grpo", "tiny_sft"):
        load_config([str(ROOT / "yaml" / f"{name}.yaml")], Config)
    tiny = load_config([TINY], Config)
    assert tiny.rollout.n == 4 and tiny.actor.optim.lr == 2e-4 and tiny.critic.optim.lr == 1e-3


def test_bad_yaml_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  dtype: float32\n  path: [unclosed\ntrainer:\n  steps: 2\n")
    msg = error_of([str(path)])
    assert msg.startswith(f"{path}:") and "invalid YAML" in msg
    line = int(msg[len(str(path)) + 1:].split(":")[0])
    assert 3 <= line <= 5, msg  # PyYAML notices the unclosed list a line or two later


def test_missing_yaml_and_non_mapping(tmp_path):
    assert "not found" in error_of([str(tmp_path / "nope.yaml")])
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert "top level must be a mapping" in error_of([str(path)])


# --- cross-field checks -----------------------------------------------------

def test_tiny_configs_pass_validation():
    assert validate(load_config([TINY], Config), 2)["num_hidden_layers"] == 4
    validate(load_config([str(ROOT / "yaml" / "tiny_grpo.yaml")], Config), 2)
    validate_sft(load_config([str(ROOT / "yaml" / "tiny_sft.yaml")], Config), 2)


@pytest.mark.parametrize("overrides, world_size, needle", [
    # world 3 with tp=2: 3 % 2 != 0
    (["parallel.tp=2"], 3, "parallel.tp*pp*cp"),
    # tiny model: 4 query heads, 2 key/value heads; tp=4 cannot split 2
    (["parallel.tp=4"], 4, "parallel.tp=4 must divide"),
    # tiny model: 4 layers; pp=3 leaves a ragged stage
    (["parallel.pp=3"], 3, "parallel.pp=3 must divide num_hidden_layers (4)"),
    (["parallel.tp=0"], 2, "parallel.tp must be >= 1"),
    (["data.batch_size=33"], 2, "data.batch_size=33"),
    (["actor.mini_batch_size=48"], 2, "actor.mini_batch_size=48 must divide"),
    (["actor.micro_batch_size=5"], 2, "actor.micro_batch_size=5"),
    (["critic.micro_batch_size=7"], 2, "critic.micro_batch_size=7"),
    (["algorithm.advantage=grpo", "critic.enable=false", "rollout.n=1"], 2, "rollout.n >= 2"),
    (["algorithm.advantage=rloo", "rollout.n=1"], 2, "rollout.n >= 2"),
    (["critic.enable=false"], 2, "critic.enable=true"),
    (["actor.dual_clip=0.5"], 2, "actor.dual_clip"),
    (["actor.gspo_clip_low=-1e-4"], 2, "actor.gspo_clip_low=-0.0001 must be >= 0"),
    (["actor.gspo_clip_high=-0.1"], 2, "actor.gspo_clip_high=-0.1 must be >= 0"),
    (["rollout.top_p=0"], 2, "rollout.top_p"),
    (["model.path=/nonexistent/model"], 2, "model.path: '/nonexistent/model' has no config.json"),
    (["critic.path=/nonexistent/critic"], 2, "critic.path:"),
    (["data.train_path=/nonexistent.jsonl"], 2, "data.train_path:"),
    (["data.eval_path=/nonexistent.jsonl"], 2, "data.eval_path:"),
])
def test_impossible_combinations_name_the_key(overrides, world_size, needle):
    assert needle in check_error(overrides, world_size)


@pytest.mark.parametrize("overrides, start", [
    # non-finite or negative optimizer numbers, any section's optim
    (["actor.optim.lr=nan"], "actor.optim.lr=nan must be a finite number > 0"),
    (["critic.optim.lr=-1e-5"], "critic.optim.lr=-1e-05 must be a finite number > 0"),
    (["actor.optim.lr=0"], "actor.optim.lr=0.0 must be a finite number > 0"),
    (["actor.optim.min_lr=-1"], "actor.optim.min_lr=-1.0 must be a finite number >= 0"),
    (["actor.optim.weight_decay=nan"], "actor.optim.weight_decay=nan must be a finite number >= 0"),
    (["actor.optim.eps=-1e-8"], "actor.optim.eps=-1e-08 must be a finite number >= 0"),
    (["critic.optim.clip_grad=inf"], "critic.optim.clip_grad=inf must be a finite number >= 0"),
    # zero batch sizes
    (["data.batch_size=0"], "data.batch_size=0 must be >= 1"),
    (["rollout.max_batch=0"], "rollout.max_batch=0 must be >= 1"),
    (["reward.model.micro_batch_size=0"], "reward.model.micro_batch_size=0 must be >= 1"),
    (["critic.micro_batch_size=0"], "critic.micro_batch_size=0 must divide"),
    # Adam betas
    (["actor.optim.betas=[0.9]"], "actor.optim.betas=[0.9] must be two numbers in [0, 1)"),
    (["actor.optim.betas=[0.9, 1.0]"], "actor.optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    (["critic.optim.betas=[nan, 0.99]"], "critic.optim.betas=[nan, 0.99] must be two numbers"),
    # reward terms
    (["reward.terms=[{name: math}, {name: math, weight: 0.5}]"], "reward.terms names 'math' twice"),
    (["reward.terms=[]"], "reward.terms=[] and reward.model.path is unset"),
    (["reward.fallback=nan"], "reward.fallback=nan must be a finite number"),
    (["reward.model.scale=inf"], "reward.model.scale=inf must be a finite number"),
    # sequence parallelism splits sequences over TP ranks (any layer spec: megarl/models/local_norm.py)
    (["parallel.sequence_parallel=true", "model.layer_spec=local"], "parallel.sequence_parallel=true needs parallel.tp > 1"),
    # loop counts
    (["trainer.steps=0"], "trainer.steps=0 must be >= 1"),
    (["trainer.steps=-3"], "trainer.steps=-3 must be >= 1"),
    (["actor.ppo_epochs=0"], "actor.ppo_epochs=0 must be >= 1"),
    (["critic.ppo_epochs=0"], "critic.ppo_epochs=0 must be >= 1"),
    (["trainer.save_every=-1"], "trainer.save_every=-1 must be >= 0"),
    (["trainer.eval_every=-1"], "trainer.eval_every=-1 must be >= 0"),
    (["trainer.eval_samples=-1"], "trainer.eval_samples=-1 must be >= 0"),
    (["trainer.keep_last=0"], "trainer.keep_last=0 must be >= 1"),
    (["trainer.max_bad_updates=-1"], "trainer.max_bad_updates=-1 must be >= 0"),
    # sampling and KL coefficients
    (["rollout.temperature=nan"], "rollout.temperature=nan must be a finite number >= 0"),
    (["rollout.top_p=nan"], "rollout.top_p=nan must be in (0, 1]"),
    (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef=-0.1 must be a finite number >= 0"),
    (["algorithm.kl_coef=nan"], "algorithm.kl_coef=nan must be a finite number >= 0"),
    (["actor.kl_loss_coef=-1"], "actor.kl_loss_coef=-1.0 must be a finite number >= 0"),
    (["actor.entropy_coef=nan"], "actor.entropy_coef=nan must be a finite number >= 0"),
    # KL terms without a reference; KL token rewards an advantage would ignore
    (["actor.kl_loss_coef=0.01", "ref.enable=false"], "actor.kl_loss_coef=0.01 needs the reference model"),
    (["algorithm.kl_in_reward=true", "ref.enable=false"], "algorithm.kl_in_reward=true needs the reference"),
    (["algorithm.kl_in_reward=true", "algorithm.advantage=grpo", "rollout.n=2"],
     "algorithm.kl_in_reward=true with algorithm.advantage=grpo"),
    # multi-turn
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=0"], "rollout.multi_turn.max_turns=0 must be >= 1"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_timeout_s=0"],
     "rollout.multi_turn.tool_timeout_s=0.0 must be a finite number > 0"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[]"], "rollout.multi_turn.tools=[]"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[python, python]"],
     "rollout.multi_turn.tools lists 'python' twice"),
    (["rollout.multi_turn.enable=true", "rollout.ignore_eos=true"], "rollout.ignore_eos=true with rollout.multi_turn"),
])
def test_bad_values_are_one_line_errors(overrides, start):
    assert check_error(overrides).startswith(start)


def test_run_dir_that_is_a_file_and_reward_specs_that_do_not_load(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    assert check_error([f"trainer.run_dir={f}"]).startswith(f"trainer.run_dir: '{f}' is a file, not a directory")
    assert check_error(["reward.terms=[{name: 'nomod:fn'}]"]).startswith(
        "reward.terms[0].name='nomod:fn': cannot import module 'nomod'")
    assert check_error(["reward.terms=[{name: nosuch}]"]).startswith(
        "reward.terms[0].name='nosuch': unknown reward function 'nosuch'; available: agent, format, math")


def test_unused_critic_knobs_not_checked():
    """GRPO trains no critic: its micro-batch and optimizer are never used."""
    cfg = load_config([str(ROOT / "yaml" / "tiny_grpo.yaml"), "critic.micro_batch_size=0",
                       "critic.optim.lr=nan"], Config)
    validate(cfg, 2)


@pytest.mark.parametrize("overrides, start", [
    (["sft.epochs=0"], "sft.epochs=0 must be >= 1"),
    (["sft.batch_size=0"], "sft.batch_size=0 must be >= 1"),
    (["sft.micro_batch_size=0"], "sft.micro_batch_size=0 must be >= 1"),
    (["sft.optim.lr=nan"], "sft.optim.lr=nan must be a finite number > 0"),
    (["sft.optim.min_lr=-1e-4"], "sft.optim.min_lr=-0.0001 must be a finite number >= 0"),
    (["parallel.sequence_parallel=true", "model.layer_spec=local"], "parallel.sequence_parallel=true needs parallel.tp > 1"),
])
def test_bad_sft_values_are_one_line_errors(overrides, start):
    cfg = load_config([str(ROOT / "yaml" / "tiny_sft.yaml"), *overrides], Config)
    with pytest.raises(ConfigError) as e:
        validate_sft(cfg, 2)
    assert "\n" not in str(e.value) and str(e.value).startswith(start), str(e.value)


@pytest.mark.parametrize("argv, world_size", [
    ([], 1),  # the dataclass defaults
    ([str(ROOT / "yaml" / "qwen2.5-1.5b.yaml")], 2),
    ([str(ROOT / "yaml" / "llama7b.yaml"), f"reward.model.path={ROOT}/megarl/assets/tiny/sft"], 8),
])
def test_default_and_large_yaml_values_validate(argv, world_size, tmp_path):
    """The big yaml files name models we do not ship: the tiny model and data stand in,
    so every value check runs on their numbers (heads/layers fit tp=2, pp=1; the stand-in
    gets 4096 positions, as the real models have, for their 512-token responses)."""
    tiny = ROOT / "megarl" / "assets" / "tiny"
    stand_in = tmp_path / "sft"
    shutil.copytree(tiny / "sft", stand_in)
    hf = json.loads((stand_in / "config.json").read_text())
    (stand_in / "config.json").write_text(json.dumps(dict(hf, max_position_embeddings=4096)))
    paths = [f"model.path={stand_in}", f"data.train_path={tiny}/train.jsonl"] if argv else []
    validate(load_config([*argv, *paths], Config), world_size)


def test_invalid_hf_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4,\n  oops}')
    msg = check_error([f"model.path={tmp_path}"])
    assert msg.startswith(f"{tmp_path / 'config.json'}:2:") and "invalid JSON" in msg


def test_sft_batch_split():
    cfg = load_config([str(ROOT / "yaml" / "tiny_sft.yaml"), "sft.micro_batch_size=5"], Config)
    with pytest.raises(ConfigError, match="sft.batch_size=64"):
        validate_sft(cfg, 2)


# --- --help text ------------------------------------------------------------

def _leaf_keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_keys(hints[f.name], f"{prefix}{f.name.rstrip('_')}.")  # async_: the key async
        else:
            yield f"{prefix}{f.name}", f.metadata.get("doc", "")


def test_every_key_documented_in_help():
    text = help_text(Config)
    for key, doc in _leaf_keys(Config):
        assert doc, f"{key} has no doc"
        assert f"  {key} = " in text and doc in text, key
    assert "  critic.optim.lr = 1e-05  (float)" in text  # the section's default, not OptimConfig's
    assert "  sft.optim.decay = 'cosine'  (constant | cosine)" in text
    assert "  model.tokenizer = None  (str | None)" in text


def test_build_from_instance_round_trips():
    cfg = load_config([TINY], Config)
    assert build(Config, cfg) == cfg


@pytest.mark.parametrize("overrides,needle", [
    (["actor.packing=false"], "parallel.cp=2 splits packed rows over the CP ranks; set actor.packing=true"),
    (["model.attention_backend=local"], "needs model.attention_backend=sdpa"),
    (["parallel.cp=8"], "parallel.cp=8 must divide the query heads per TP rank (4) and divide or be a multiple"),
])
def test_context_parallel_config_errors(overrides, needle):
    msg = check_error(["parallel.cp=2", *overrides], world_size=2 if "cp=8" not in overrides[0] else 8)
    assert needle in msg


def test_context_parallel_validates():
    validate(load_config([TINY, "parallel.cp=2"], Config), 2)


def test_replay_dir_without_dumps_is_a_config_error(tmp_path):
    msg = check_error([f"trainer.replay_rollouts={tmp_path}"])
    assert msg.startswith(f"trainer.replay_rollouts: '{tmp_path}' holds no dumped rollouts")
    msg = check_error([f"trainer.replay_rollouts={tmp_path / 'missing'}"])
    assert "holds no dumped rollouts" in msg


# --- issue 39: bad input that used to end in a traceback or pass silently ----

@pytest.mark.parametrize("overrides, start", [
    (["model.vocab_divisible_by=0"], "model.vocab_divisible_by=0 must be >= 1"),
    (["rollout.top_k=0"], "rollout.top_k=0 keeps no token; use a count >= 1, or -1"),
    (["rollout.top_k=-2"], "rollout.top_k=-2 keeps no token"),
    # the tiny model has vocab_size 57: ids 0..56
    (["rollout.stop_token_ids=[3, 57]"], "rollout.stop_token_ids: [57] outside the vocabulary"),
    (["rollout.stop_token_ids=[-1]"], "rollout.stop_token_ids: [-1] outside the vocabulary"),
    (["trainer.run_dir="], "trainer.run_dir is empty"),
])
def test_more_bad_values_are_one_line_errors(overrides, start):
    assert check_error(overrides).startswith(start)


def test_output_dirs_that_cannot_be_created(tmp_path):
    """A run_dir under a file, and a dump_rollouts naming a file: one line each, before any process starts."""
    f = tmp_path / "afile"
    f.write_text("x")
    msg = check_error([f"trainer.run_dir={f}/run"])
    assert msg == f"trainer.run_dir: '{f}/run' cannot be created: '{f}' is not a directory; pick another path"
    msg = check_error([f"trainer.run_dir={tmp_path}/run", f"trainer.dump_rollouts={f}"])
    assert msg.startswith(f"trainer.dump_rollouts: '{f}' is a file, not a directory")
    validate(load_config([TINY, f"trainer.run_dir={tmp_path}/a/b/c", f"trainer.dump_rollouts={tmp_path}/d"],
                         Config), 2)


def test_replay_needs_every_step_dumped_up_front(tmp_path):
    """5 steps dumped for 2 DP ranks: trainer.steps=5 passes; 6 names the first missing step and the fix;
    one DP rank's file missing for step 3 names that rank; replaying on 4 DP ranks is refused."""
    from megarl.trainer.run_config import validate_run

    for step in range(1, 6):
        for r in range(2):
            (tmp_path / f"step_{step:06d}_dp{r}.pt").write_bytes(b"")
    base = [TINY, f"trainer.replay_rollouts={tmp_path}"]
    validate_run(load_config([*base, "trainer.steps=5"], Config), 2)
    msg = check_error(["trainer.steps=6"], base=base, check=validate_run)
    assert msg == (f"trainer.replay_rollouts: '{tmp_path}' has no dump of step 6 for data-parallel rank 0 (dumped: "
                   "steps 1..5); set trainer.steps=5 or fewer, or dump more steps with the same data-parallel size")
    (tmp_path / "step_000003_dp1.pt").unlink()
    assert "no dump of step 3 for data-parallel rank 1" in check_error(["trainer.steps=5"], base=base, check=validate_run)
    assert "no dump of step 1 for data-parallel rank 2" in check_error(["trainer.steps=2", "actor.micro_batch_size=8", "critic.micro_batch_size=8"], 4, base=base, check=validate_run)


def test_help_prints_a_sections_own_keys_before_its_sub_sections():
    """rollout.n belongs under [rollout], not under [rollout.sglang] printed before it."""
    lines = help_text(Config).splitlines()
    header = {line.split("]")[0][1:]: i for i, line in enumerate(lines) if line.startswith("[")}
    at = {line.split(" = ")[0].strip(): i for i, line in enumerate(lines) if " = " in line}
    for key, i in at.items():
        section = key.rsplit(".", 1)[0]
        between = [h for h, j in header.items() if header[section] < j < i]
        assert not between, f"{key} printed under [{between[-1]}]"


def test_resume_takes_a_bool_or_force():
    assert [load_config([f"trainer.resume={v}"], Config).trainer.resume for v in ("force", "false", "true")] == [
        "force", False, True]
    assert error_of(["trainer.resume=maybe"]) == "trainer.resume: expected bool or force, got 'maybe'"


def test_default_run_dir_comes_from_the_yaml_name(tmp_path):
    (tmp_path / "my_grpo.yaml").write_text("algorithm:\n  advantage: grpo\n")
    assert load_config([str(tmp_path / "my_grpo.yaml")], Config).trainer.run_dir == "runs/my_grpo"
    assert load_config([str(tmp_path / "my_grpo.yaml"), "trainer.run_dir=x"], Config).trainer.run_dir == "x"
    assert load_config([], Config).trainer.run_dir == "runs/default"


def test_yaml_relative_paths(tmp_path, monkeypatch):
    """An input path in a yaml is read from the working directory when it exists there, else from the
    yaml's directory; one found in neither stays as written (a hub id, or a missing file the checks name).
    A command-line override is always from the working directory."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shutil.copy(ROOT / "megarl" / "assets" / "tiny" / "train.jsonl", project / "data" / "train.jsonl")
    (project / "run.yaml").write_text("data:\n  train_path: data/train.jsonl\n  eval_path: data/none.jsonl\n"
                                      "model:\n  path: Qwen/Qwen2.5-0.5B-Instruct\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["project/run.yaml"], Config)
    assert cfg.data.train_path == "project/data/train.jsonl"
    assert cfg.data.eval_path == "data/none.jsonl" and cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert load_config(["project/run.yaml", "data.train_path=data/train.jsonl"], Config).data.train_path == \
        "data/train.jsonl"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    assert load_config(["project/run.yaml"], Config).data.train_path == "data/train.jsonl"  # the CWD wins


def test_resume_refuses_a_run_dir_of_another_config(tmp_path):
    """RUN_DIR/config.yaml of a PPO-with-critic run and a checkpoint: a GRPO config pointed at it is one
    line naming each difference (algorithm, critic, reward); trainer.resume=force returns the same
    differences instead, false starts over; the same config, or a changed learning rate, resumes."""
    from megarl.trainer.run_config import check_resume, save_run_config

    run = f"trainer.run_dir={tmp_path}"
    save_run_config(load_config([TINY, run], Config))
    assert check_resume(load_config([str(ROOT / "yaml" / "tiny_grpo.yaml"), run], Config)) == []  # no checkpoint yet
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("40")
    grpo = [str(ROOT / "yaml" / "tiny_grpo.yaml"), run, "reward.terms=[{name: format}]"]
    with pytest.raises(ConfigError) as e:
        check_resume(load_config(grpo, Config))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"trainer.run_dir '{tmp_path}' holds a run of another config (")
    assert "algorithm.advantage 'gae' -> 'grpo'" in msg and "critic.enable True -> False" in msg
    assert "reward.terms [('math', 1.0, {})] -> [('format', 1.0, {})]" in msg
    assert msg.endswith("trainer.resume=force to continue it anyway")
    forced = check_resume(load_config([*grpo, "trainer.resume=force"], Config))
    assert forced[0] == "algorithm.advantage 'gae' -> 'grpo'" and len(forced) == 4  # + critic.path
    assert check_resume(load_config([*grpo, "trainer.resume=false"], Config)) == []
    assert check_resume(load_config([TINY, run, "actor.optim.lr=3e-4", "trainer.steps=80"], Config)) == []
    other_data = tmp_path / "train.jsonl"
    shutil.copy(ROOT / "megarl" / "assets" / "tiny" / "train.jsonl", other_data)
    with pytest.raises(ConfigError, match=r"data.train_path '.*/megarl/assets/tiny/train.jsonl' -> '.*/train.jsonl'"):
        check_resume(load_config([TINY, run, f"data.train_path={other_data}"], Config))

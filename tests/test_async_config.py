"""trainer.mode=async: bad placements are one line and exit 2, before any process group is joined.

The world size comes from the launcher's environment (RANK / WORLD_SIZE as torchrun sets them);
validation runs before the rendezvous, so one process stands in for a whole launch. The section
is written ``async`` (a Python keyword: the dataclass field is ``async_``) in yaml, overrides and
--help.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ppo(world: int, *overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "launch/ppo.py", "yaml/tiny_async.yaml", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("world, overrides, message", [
    (1, [], "config error: trainer.mode=async needs at least 2 ranks (one rollout, one training), got 1; "
            "start more processes (torchrun --nproc_per_node 2) or set trainer.mode=sync"),
    (2, ["placement.rollout_ranks=2"], "config error: placement.rollout_ranks=2 does not cover the world of 2 "
                                       "ranks with both roles; use 1 .. 1 (the rest train)"),
    (3, ["placement.rollout_tp=2"], "config error: placement.rollout_tp=2 must divide placement.rollout_ranks=1 "
                                    "(a rollout TP group lives inside the rollout ranks)"),
    (3, [], "config error: placement: 1 rollout replicas (rollout_ranks / rollout_tp) must equal the 2 training "
            "data-parallel replicas; change placement.rollout_ranks, placement.rollout_tp or parallel.tp"),
    (2, ["async.max_staleness=-1"], "config error: async.max_staleness=-1 must be >= 0, async.queue_size=2 >= 1 "
                                    "and async.bucket_mb=64.0 > 0"),
    (4, ["parallel.pp=2", "placement.rollout_ranks=2"], "config error: placement: 2 rollout replicas (rollout_ranks / "
     "rollout_tp) must equal the 1 training data-parallel replicas; change placement.rollout_ranks, "
     "placement.rollout_tp or parallel.tp"),
])
def test_bad_placement_one_line_exit_2(world, overrides, message):
    p = _ppo(world, *overrides)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.splitlines() == [message]


def _validate(config: str, world: int, *overrides) -> str:
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import validate
    from megarl.errors import ConfigError

    cfg = load_config([str(ROOT / "yaml" / config), *overrides], Config)
    try:
        validate(cfg, world)
    except ConfigError as e:
        return str(e)
    return "no error"


MOE_ASYNC = ("trainer.mode=async", "placement.rollout_ranks=2")  # yaml/tiny_moe.yaml is EP2: dense DP 2


@pytest.mark.parametrize("config, world, overrides", [
    ("tiny_async.yaml", 3, ["parallel.pp=2"]),
    ("tiny_async.yaml", 2, ["actor.lora.rank=4"]),
    ("tiny_moe.yaml", 4, [*MOE_ASYNC]),  # EP2 and actor.router_replay=r3
    ("tiny_moe.yaml", 3, [*MOE_ASYNC, "parallel.ep=1", "placement.rollout_tp=2"]),  # MoE rollout copy at TP2
    ("tiny_moe.yaml", 6, [*MOE_ASYNC, "parallel.pp=2", "actor.lora.rank=4", "actor.lora.experts=true"]),
])
def test_async_training_layouts_accepted(config, world, overrides):
    """PP, EP (with router replay) and LoRA on the training ranks: the weight push gathers them."""
    assert _validate(config, world, *overrides) == "no error"


@pytest.mark.parametrize("config, world, overrides", [
    ("tiny_async.yaml", 2, []),
    ("tiny_async.yaml", 3, ["parallel.pp=2"]),  # SGLang at the rollout layout (PP 1): the training side may use PP
    ("tiny_async.yaml", 3, ["parallel.cp=2", "actor.packing=true", "model.attention_backend=sdpa"]),
    ("tiny_async.yaml", 2, ["actor.lora.rank=4"]),  # the push sends W + s B A merged
    ("tiny_async.yaml", 4, ["placement.rollout_ranks=2", "placement.rollout_tp=2", "parallel.tp=2"]),  # TP2 -> TP2
    ("tiny_moe.yaml", 4, [*MOE_ASYNC, "actor.router_replay=none"]),
    ("tiny_moe.yaml", 4, [*MOE_ASYNC]),  # actor.router_replay=r3: SGLang returns the expert ids
])
def test_async_sglang_accepted(config, world, overrides):
    """rollout.engine=sglang on the rollout ranks: the refusals that protect a colocated SGLang (PP, CP,
    LoRA on the training layout) do not apply; the pushed weights arrive merged and whole."""
    assert _validate(config, world, "rollout.engine=sglang", *overrides) == "no error"


@pytest.mark.parametrize("config, world, overrides, message", [
    ("tiny_async.yaml", 2, ["rollout.partial=true", "async.max_staleness=2"], "rollout.partial=true does not work "
     "with rollout.engine=sglang (only the native engine stops a generation and resumes its requests); or set "
     "rollout.partial=false"),
    ("tiny_async.yaml", 2, ["trainer.mode=sync", "parallel.pp=2"], "rollout.engine=sglang needs parallel.pp=1 (got "
     "2); use rollout.engine=native"),  # colocated: SGLang holds the whole model per TP group
])
def test_async_sglang_refusals(config, world, overrides, message):
    assert _validate(config, world, "rollout.engine=sglang", *overrides) == message


@pytest.mark.parametrize("world, overrides, message", [
    (3, ["placement.rollout_ranks=1"], "placement: 1 rollout replicas (rollout_ranks / rollout_tp) must equal the 2 "
     "training data-parallel replicas; change placement.rollout_ranks, placement.rollout_tp or parallel.tp"),
])
def test_async_moe_refusals(world, overrides, message):
    """The rule "rollout replicas == training data-parallel replicas" counts dense DP replicas (EP2 over 2
    training ranks is still 2 of them)."""
    assert _validate("tiny_moe.yaml", world, *MOE_ASYNC, *overrides) == message


def test_async_key_spelling():
    """``async.*`` is the key everywhere: --help lists it, an unknown one gets a suggestion."""
    p = subprocess.run([sys.executable, "launch/ppo.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert "async.max_staleness = 1" in p.stdout and "[async]" in p.stdout
    bad = _ppo(2, "async.max_stalenes=1")
    assert bad.returncode == 2 and bad.stderr.startswith("config error: unknown key 'async.max_stalenes'")


def _validated(*overrides):
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import validate

    cfg = load_config([str(ROOT / "yaml" / "tiny_async.yaml"), *overrides], Config)
    validate(cfg, 2)
    return cfg


@pytest.mark.parametrize("overrides", [
    ["reward.model.path=megarl/assets/tiny/sft"],  # the rollout ranks build and run it (async_rollout.py)
    ["algorithm.dapo.dynamic_sampling=true", "algorithm.dapo.max_rounds=2"],
    ["algorithm.advantage=remax", "reward.model.path=megarl/assets/tiny/sft"],
    ["rollout.partial=true", "async.max_staleness=2"],  # the rollout ranks keep the groups in flight
])
def test_scoring_and_sampling_options_pass_in_async(overrides):
    """A reward model, dynamic sampling, ReMax's greedy baseline and partial rollouts run on the rollout ranks."""
    assert _validated(*overrides).trainer.mode == "async"


@pytest.mark.parametrize("overrides, key, why", [
    (["trainer.rollout_only=true"], "trainer.replay_rollouts / rollout_only", "each half already runs alone"),
])
def test_still_refused_in_async(overrides, key, why):
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _validated(*overrides)
    assert str(e.value) == f"{key} is not supported with trainer.mode=async ({why}); unset it or use trainer.mode=sync"

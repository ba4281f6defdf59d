"""Shared pytest setup: markers, tests/ on sys.path for the helpers, and the tiny Llama checkpoint fixture."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "slow: long CPU test (a shortened training run)")
    config.addinivalue_line("markers", "container: builds and runs the Docker image with buildah (root; .ci/run runs "
                            "these on their own, tests/test_container.py)")


def pytest_collection_modifyitems(config, items):
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random tiny Llama checkpoint (GQA, 57-token vocab padded per TP rank, eos 3) in a temp dir."""
    from megarl.models.tiny import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint(str(path), "LlamaForCausalLM", seed=0, vocab_size=57, eos_token_id=3)
    return str(path)


@pytest.fixture(scope="session")
def straight_tiny_run(tmp_path_factory):
    """4 uninterrupted PPO steps of the tiny task under torchrun (2 processes, the small settings of
    test_trainer_runs, one checkpoint at the end): the run that interrupted and resumed runs must
    equal bitwise. Its directory (metrics.jsonl, hf/)."""
    from test_trainer_runs import SMALL, ppo

    run = tmp_path_factory.mktemp("straight")
    ppo("yaml/tiny.yaml", run, *SMALL, "trainer.save_every=0", steps=4)
    return run

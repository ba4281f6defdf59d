"""megarl: RL post-training (PPO, GRPO, ...) for LLMs on megatron-core.

CPU machines: install the CPU build of torch first, so pip does not pull a
multi-GB CUDA build to satisfy the `torch` requirement below:

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    pip install -e .[dev]
"""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training for large language models on megatron-core",
    python_requires=">=3.10",
    # The Triton kernels keep their top-level folder, kernels/, and are imported as
    # `megarl_kernels` from kernels/megarl_kernels/: the bare name `kernels` belongs to
    # Hugging Face's `kernels` distribution, which transformers imports, and a folder named
    # after its import name lets a reader (and any import-graph tool) follow
    # `from megarl_kernels.gae import gae` to kernels/megarl_kernels/gae.py. Without an
    # install, put kernels/ on the path: PYTHONPATH=$PWD:$PWD/kernels.
    packages=find_packages(include=["megarl", "megarl.*"]) + find_packages("kernels"),
    package_dir={"megarl_kernels": "kernels/megarl_kernels"},
    package_data={"megarl": ["assets/**/*"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "transformers>=4.50",
        "safetensors",
        "tokenizers",
        "pyyaml",
        "numpy",
        "psutil",
        "nvidia-ml-py",  # pynvml: GPU utilization, memory and power for the resource monitor
        "matplotlib",  # RUN_DIR/curves.png at the end of a run
        "tensorboard",
        "tqdm",
        "pyarrow",
        "redis>=5",  # client for reward.cache=redis (pure Python)
        "datasets",  # prompt sets from save_to_disk directories and hub names (megarl/data/sources.py)
    ],
    entry_points={"console_scripts": ["megarl = megarl.launcher:main"]},  # megarl train CONFIG.yaml --nproc N
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "sglang": ["sglang==0.5.23"],  # the release megarl/rollout/sglang.py is written against
        "mpi": ["mpi4py", "mpich"],
        "wandb": ["wandb"],  # trainer.wandb.enable=true
        # rollout.server: the OpenAI endpoint (aiohttp) and the openai client the shipped agents use
        "server": ["aiohttp>=3.9", "openai>=1.40"],
        # benchmarks/bench_e2e.py's other side: TRL's GRPOTrainer at the release it was measured with
        # (+ aiohttp and openai: benchmarks/bench_server.py, the endpoint against the engine)
        "bench": ["trl==1.16.0", "datasets>=4.8,<5", "accelerate>=1.10.1", "aiohttp>=3.9", "openai>=1.40"],
        # wandb: the offline-mode logging test; pytest-xdist: the suite on 2 workers (half the time on 2 cores);
        # aiohttp + openai: the rollout.server tests (tests/test_rollout_http.py)
        "dev": ["pytest", "pytest-xdist", "triton", "wandb", "aiohttp>=3.9", "openai>=1.40"],
    },
)

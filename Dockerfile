# megarl GPU image for clusters: NVIDIA's PyTorch container (CUDA, cuDNN, NCCL,
# PyTorch, Transformer Engine, apex, Open MPI) plus megarl and megatron-core.
#
#   docker build -t megarl .                                   # native rollout engine
#   docker build --build-arg WITH_SGLANG=1 -t megarl:sglang .  # + SGLang (see below)
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3 -t megarl .
#
#   docker run --gpus all --ipc=host --rm megarl                 # prints the config keys
#   docker run --gpus all --ipc=host --rm -v $PWD/runs:/opt/megarl/runs \
#       -v /models:/models -v /data:/data megarl \
#       torchrun --nproc_per_node 8 launch/ppo.py yaml/llama7b.yaml model.path=/models/Llama-2-7b-hf \
#       reward.model.path=/models/reward-7b data.train_path=/data/prompts.jsonl trainer.steps=200
#   (yaml/llama7b.yaml holds /path/to/... placeholders for those three keys; the
#   tiny run needs none: ... megarl python launch/ppo.py yaml/tiny.yaml)
#   On SLURM: MEGARL_IMAGE=megarl:latest sbatch launch/slurm/ppo.sbatch ... (enroot/pyxis),
#   or MEGARL_APPTAINER=megarl.sif (launch/slurm/README.md).
#
# Not built or run in megarl's CI: the CPU machines it runs on cannot pull the
# base image. Check a new BASE_IMAGE by building it and running the smoke test
# at the end of this file.

# 25.12: PyTorch 2.10, CUDA 13.1 (needs an R580+ driver); for an older driver
# take a release built on CUDA 12.x (25.03 or later keeps the pip constraints
# file relied on below).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

# SGLang (for rollout.engine=sglang, megarl/rollout/sglang.py; the native engine needs
# none) pins its own torch release, which replaces the container's PyTorch and
# can break the Transformer Engine and apex builds that came with it; off by
# default. With WITH_SGLANG=1 the container's pip constraints are bypassed for
# that one install, and the smoke test below reports what still imports.
ARG WITH_SGLANG=0
ARG SGLANG_SPEC=sglang==0.5.23

ENV NCCL_NVLS_ENABLE=0 \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/megarl
COPY . /opt/megarl

# The container's torch, transformer-engine and apex stay: its pip constraints
# file (/etc/pip/constraint.txt) keeps pip from replacing them, so megarl[te]
# is not needed. mpi4py is compiled against the container's Open MPI (the
# mpich wheel of megarl[mpi] would bring a second MPI).
RUN pip install -e . \
 && MPICC=mpicc pip install --no-binary=mpi4py mpi4py

RUN if [ "$WITH_SGLANG" = 1 ]; then PIP_CONSTRAINT="" pip install "$SGLANG_SPEC"; fi

# Smoke test: imports, the entry script's --help, and which extras the image has.
RUN python -c "import importlib.util as u, torch, megatron.core, megarl_kernels, mpi4py; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__); \
print({m: u.find_spec(m) is not None for m in ('transformer_engine', 'apex', 'sglang', 'triton')})"
RUN python launch/ppo.py --help > /dev/null

CMD ["python", "launch/ppo.py", "--help"]

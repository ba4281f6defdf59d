# megarl GPU image for clusters: NVIDIA's PyTorch container (CUDA, cuDNN, NCCL,
# PyTorch, Transformer Engine, apex, Open MPI) plus megarl and megatron-core.
#
#   docker build -t megarl .                                   # native rollout engine
#   docker build --build-arg WITH_SGLANG=1 -t megarl:sglang .  # + SGLang (see below)
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3 -t megarl .
#
#   docker run --gpus all --ipc=host --rm megarl                 # prints the config keys
#   docker run --gpus all --ipc=host --rm --user $(id -u):$(id -g) -v $PWD/runs:/runs \
#       -v /models:/models -v /data:/data megarl \
#       torchrun --nproc_per_node 8 launch/ppo.py yaml/llama7b.yaml model.path=/models/Llama-2-7b-hf \
#       reward.model.path=/models/reward-7b data.train_path=/data/prompts.jsonl \
#       trainer.run_dir=/runs/llama7b trainer.steps=200
#   (yaml/llama7b.yaml holds /path/to/... placeholders for those three keys; the
#   tiny run needs none: ... megarl torchrun --nproc_per_node 2 launch/ppo.py yaml/tiny.yaml
#   trainer.run_dir=/runs/tiny. With --user the run directory's files are the host
#   user's; /opt/megarl itself is read-only to that user, so write under a mount.)
#   On SLURM, from a local image file: launch/slurm/README.md (enroot/pyxis .sqsh or
#   apptainer .sif, both made from `buildah push ... oci-archive:megarl.oci.tar`).
#
# Built and run in megarl's CI without Docker or NVIDIA's image: tests/test_container.py
# builds this file with buildah on docker/stand-in-base.sh (Debian, CPU torch, Open MPI;
# only BASE_IMAGE changes) and runs PPO, the smoke test and convert.py in the image.
# Check a new BASE_IMAGE on a GPU machine by building it: the smoke test runs at the end.

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

# Labels: the release (keep in step with setup.py; tests/test_container.py compares them) and
# where the source came from: --build-arg MEGARL_SOURCE=$(git remote get-url origin)
# --build-arg MEGARL_REVISION=$(git rev-parse HEAD).
ARG BASE_IMAGE
ARG MEGARL_VERSION=0.1.0
ARG MEGARL_SOURCE=unknown
ARG MEGARL_REVISION=unknown
LABEL org.opencontainers.image.title="megarl" \
      org.opencontainers.image.description="RL post-training for LLMs on megatron-core" \
      org.opencontainers.image.version="${MEGARL_VERSION}" \
      org.opencontainers.image.source="${MEGARL_SOURCE}" \
      org.opencontainers.image.revision="${MEGARL_REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

ENV NCCL_NVLS_ENABLE=0 \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/megarl

# Dependencies, in layers of their own: built from setup.py alone, so a change to the
# source does not reinstall them. With no package folders beside it, `pip install .`
# installs megarl's requirements and an empty megarl, removed at once (the editable
# install below is the real one). The container's torch, transformer-engine and apex
# stay: its pip constraints file (/etc/pip/constraint.txt) keeps pip from replacing
# them, so megarl[te] is not needed. mpi4py is compiled against the container's Open
# MPI (the mpich wheel of megarl[mpi] would bring a second MPI).
COPY setup.py /opt/megarl/
RUN pip install /opt/megarl \
 && pip uninstall -y megarl \
 && rm -rf /opt/megarl/build /opt/megarl/megarl.egg-info \
 && MPICC=mpicc pip install --no-binary=mpi4py mpi4py

RUN if [ "$WITH_SGLANG" = 1 ]; then PIP_CONSTRAINT="" pip install "$SGLANG_SPEC"; fi

COPY docker/entrypoint.sh /usr/local/bin/megarl-entrypoint

# The source: megarl and megarl_kernels (kernels/megarl_kernels) as an editable install,
# so launch/, yaml/ and megarl/assets/ are used in place.
COPY . /opt/megarl
RUN pip install --no-deps -e . \
 && chmod -R a+rX /opt/megarl

# Smoke test: the packages import from /opt/megarl outside it, the entry script's
# --help, and which extras the image has.
RUN cd / && python -c "import importlib.util as u, torch, megatron.core, megarl, megarl_kernels, mpi4py; \
assert megarl.__file__.startswith('/opt/megarl/') and megarl_kernels.__file__.startswith('/opt/megarl/kernels/'), \
    (megarl.__file__, megarl_kernels.__file__); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__); \
print({m: u.find_spec(m) is not None for m in ('transformer_engine', 'apex', 'sglang', 'triton')})"
RUN python launch/ppo.py --help > /dev/null

# Any user: `docker run --user $(id -u):$(id -g)` (files in a mounted run directory are then
# the host user's); the entrypoint gives a user with no home in the image a writable HOME.
ENTRYPOINT ["/usr/local/bin/megarl-entrypoint"]
CMD ["python", "launch/ppo.py", "--help"]

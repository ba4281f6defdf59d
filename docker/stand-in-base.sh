#!/usr/bin/env bash
# A stand-in for NVIDIA's PyTorch image, so the Dockerfile can be built and run on a
# CPU machine that cannot pull nvcr.io: a Debian bookworm root from debootstrap,
# committed with buildah (no Docker daemon) as a local image.
#
#   docker/stand-in-base.sh [IMAGE]          # default: localhost/megarl-stand-in-base:<tag>
#   buildah bud --build-arg BASE_IMAGE=IMAGE ...   (tests/test_container.py does this)
#
# What the Dockerfile expects of NVIDIA's image, at the same paths:
#   python, python3, pip on PATH, installing system-wide (no PEP 668 block), the CPU
#   build of torch ($TORCH_SPEC) in place of CUDA's, the pip constraints file
#   /etc/pip/constraint.txt named by PIP_CONSTRAINT (it pins torch, so `pip install`
#   keeps the image's build), Open MPI with mpicc and a C compiler (mpi4py is built
#   from source), and setuptools for `pip install -e`.
# Not there: CUDA, Transformer Engine, apex (the Dockerfile's smoke test reports them).
#
# Prints the image name on its last line. Reuses an image of that name when present
# (the tag hashes this script and TORCH_SPEC, so an edit makes a new one); needs root,
# debootstrap, buildah, and Debian's archive and PyPI. Knobs:
#   TORCH_SPEC     default torch==2.13.0+cpu (the release CI tests with)
#   TORCH_WHEEL    a local wheel of it for CPython 3.11; else pip downloads one (the host's
#                  pip configuration, plus the PyTorch CPU index)
#   DEBIAN_MIRROR  default http://deb.debian.org/debian
#   STORAGE_DRIVER default vfs (buildah's --storage-driver: works without kernel overlay support)
#   BUILDAH_ROOT   buildah's storage folder (--root; default: buildah's own)
#   STAND_IN_CACHE downloaded .deb files, kept for the next build (default /var/tmp/megarl-stand-in-cache)
#   HOST_CA_BUNDLE the host's CA certificates, lent to pip while it installs torch's dependencies
#                  (default $PIP_CERT, else /etc/ssl/certs/ca-certificates.crt; for a TLS-inspecting proxy)
set -euo pipefail

TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${STAND_IN_CACHE:-/var/tmp/megarl-stand-in-cache}
export BUILDAH_ISOLATION=chroot
buildah() { command buildah --storage-driver "${STORAGE_DRIVER:-vfs}" ${BUILDAH_ROOT:+--root "$BUILDAH_ROOT" --runroot "$BUILDAH_ROOT/run"} "$@"; }
HERE=$(cd "$(dirname "$0")" && pwd)
TAG=$(cat "$0" <(echo "$TORCH_SPEC") | sha256sum | cut -c1-12)
IMAGE=${1:-localhost/megarl-stand-in-base:$TAG}
# Debian bookworm's Python is 3.11 (NVIDIA's 25.x images have 3.12): one CPython, system-wide.
PACKAGES="python3-pip python3-dev python3-setuptools python-is-python3 gcc libc6-dev openmpi-bin libopenmpi-dev ca-certificates"

if buildah inspect --type image "$IMAGE" > /dev/null 2>&1; then
    echo "stand-in base $IMAGE is already built" >&2
    echo "$IMAGE"
    exit 0
fi

say() { echo "stand-in-base.sh $(date +%T): $*" >&2; }
work=$(mktemp -d)
ctr=""
cleanup() {
    [ -z "$ctr" ] || buildah rm "$ctr" > /dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

wheel=${TORCH_WHEEL:-}
if [ -z "$wheel" ]; then
    say "downloading $TORCH_SPEC for CPython 3.11"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 -d "$work" "$TORCH_SPEC" \
        --extra-index-url https://download.pytorch.org/whl/cpu >&2
    wheel=$(ls "$work"/torch-*.whl)
fi
[ -f "$wheel" ] || { echo "TORCH_WHEEL=$wheel: no such file" >&2; exit 2; }

ctr=$(buildah from scratch)
root=$(buildah mount "$ctr")
mkdir -p "$CACHE/debs"
say "debootstrap bookworm into $ctr"
# apt-get rather than debootstrap --include: debootstrap's resolver skips virtual packages
# (libltdl-dev's automake-1.16), which leaves Open MPI's headers unconfigured.
debootstrap --variant=minbase --cache-dir="$CACHE/debs" bookworm "$root" "$MIRROR" > "$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
say "apt-get install $PACKAGES"
buildah run -v "$CACHE/debs:/var/cache/apt/archives" "$ctr" -- sh -c "apt-get update -qq && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES > /dev/null" >&2
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
rm -rf "$root"/var/lib/apt/lists/*
mkdir -p "$root/etc/pip"
version=${TORCH_SPEC#torch==}
echo "torch==$version" > "$root/etc/pip/constraint.txt"
cp "$wheel" "$root/tmp/"
buildah config --env PIP_CONSTRAINT=/etc/pip/constraint.txt --env PIP_DISABLE_PIP_VERSION_CHECK=1 \
    --env PIP_NO_CACHE_DIR=1 --env LANG=C.UTF-8 --workingdir /workspace --cmd /bin/bash \
    --label org.opencontainers.image.description="megarl's stand-in for nvcr.io/nvidia/pytorch (CPU torch, $HERE/stand-in-base.sh)" \
    "$ctr"
say "pip install $(basename "$wheel")"
ca=${HOST_CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
ca_mount=()
[ ! -f "$ca" ] || ca_mount=(-v "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
buildah run ${ca_mount[@]+"${ca_mount[@]}"} "$ctr" -- sh -c "PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    pip install -q /tmp/$(basename "$wheel") && rm /tmp/*.whl" >&2
buildah run "$ctr" -- python -c "import torch; assert torch.__version__ == '$version', torch.__version__" >&2
buildah umount "$ctr" > /dev/null
buildah commit -q --rm "$ctr" "$IMAGE" > /dev/null
ctr=""
say "built $IMAGE"
echo "$IMAGE"

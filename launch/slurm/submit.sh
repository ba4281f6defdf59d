#!/usr/bin/env bash
# Checks the config, then submits launch/slurm/ppo.sbatch: a mistake is one line here
# (exit 2) instead of a job that waits in the queue and fails at its start.
#
#   launch/slurm/submit.sh [SBATCH OPTIONS ...] CONFIG.yaml [key=value ...]
#   launch/slurm/submit.sh -N 4 --time=12:00:00 yaml/llama7b.yaml model.path=/models/Llama-2-7b-hf ...
#
# The check (launch/slurm/check_config.py) runs the entry script's config checks for
# the job's world size, with the megarl the job will run: the image's under
# MEGARL_APPTAINER (apptainer exec, no GPU needed), else the python on PATH (after
# MEGARL_VENV). Under MEGARL_IMAGE (pyxis) the image cannot be entered outside srun,
# so the host's megarl checks it; without one there, MEGARL_CHECK=0 submits unchecked.
# The environment (MEGARL_*, GPUS_PER_NODE) is passed on to the job by sbatch.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
SBATCH_ARGS=()
while [ $# -gt 0 ] && [[ "$1" != *.yaml && "$1" != *.yml ]]; do
    SBATCH_ARGS+=("$1")
    shift
done
[ $# -gt 0 ] || { echo "usage: launch/slurm/submit.sh [SBATCH OPTIONS ...] CONFIG.yaml [key=value ...]" >&2; exit 2; }

if [ "${MEGARL_CHECK:-1}" != 0 ]; then
    CHECK=(python "$HERE/check_config.py")
    if [ -n "${MEGARL_APPTAINER:-}" ]; then
        [ -f "$MEGARL_APPTAINER" ] || { echo "MEGARL_APPTAINER=$MEGARL_APPTAINER: no such image file" >&2; exit 2; }
        CHECK=(apptainer exec --pwd "$PWD" --bind "$PWD${MEGARL_MOUNTS:+,$MEGARL_MOUNTS}" "$MEGARL_APPTAINER"
               python /opt/megarl/launch/slurm/check_config.py)
    elif [ -n "${MEGARL_VENV:-}" ]; then
        # shellcheck disable=SC1091
        . "$MEGARL_VENV/bin/activate"
    fi
    if [ -z "${MEGARL_APPTAINER:-}" ] && ! python -c "import megarl" 2> /dev/null; then
        echo "cannot check the config: no megarl for '$(command -v python || echo python)' (set MEGARL_VENV, or MEGARL_CHECK=0 to submit unchecked)" >&2
        exit 2
    fi
    "${CHECK[@]}" ${SBATCH_ARGS[@]+"${SBATCH_ARGS[@]}"} "$@"
fi
exec sbatch ${SBATCH_ARGS[@]+"${SBATCH_ARGS[@]}"} "$HERE/ppo.sbatch" "$@"

#!/usr/bin/env bash
# Poly on SLURM: one learner job plus an array of env client jobs that connect to it.
#
#   scripts/slurm/poly.sh RUN_DIR NUM_CLIENT_JOBS [overrides for both, e.g. env=pong backend.num_actors=8]
#
# Resources come from sbatch options in LEARNER_SBATCH and CLIENTS_SBATCH (defaults below; add
# --partition=..., --time=..., --account=... as your cluster needs). Client jobs start once the
# learner has started (--dependency=after) and exit 0 when it finishes; if the learner fails they
# give up after backend.connect_timeout_s. Prints the two job ids. Run from the repo root with the
# virtualenv active: sbatch exports this shell's environment (PATH, TORCHBEAST_TOKEN) to the jobs.
set -euo pipefail
if [[ $# -lt 2 ]]; then sed -n '2,12p' "$0"; exit 2; fi
HERE=$(cd "$(dirname "$0")" && pwd)
RUN_DIR=$(realpath -m "$1"); CLIENT_JOBS=$2; shift 2
LEARNER_SBATCH=${LEARNER_SBATCH:---gpus-per-node=1 --cpus-per-task=8 --time=24:00:00}
CLIENTS_SBATCH=${CLIENTS_SBATCH:---cpus-per-task=8 --time=24:00:00}
command -v sbatch >/dev/null || { echo "error: sbatch is not on PATH (locally: make slurm-start)" >&2; exit 2; }
[[ $CLIENT_JOBS =~ ^[1-9][0-9]*$ ]] || { echo "error: NUM_CLIENT_JOBS must be a positive integer" >&2; exit 2; }
if [[ -z ${TORCHBEAST_TOKEN:-} ]]; then
  TORCHBEAST_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe())')
fi
PYTHON=${PYTHON:-$(command -v python || command -v python3)}  # the jobs' interpreter (this virtualenv's)
export RUN_DIR TORCHBEAST_TOKEN PYTHON
mkdir -p "$RUN_DIR/slurm"
rm -f "$RUN_DIR/actorpool_address"  # a previous learner's address must not mislead the clients
# shellcheck disable=SC2086  # the *_SBATCH variables are lists of options
learner=$(sbatch --parsable $LEARNER_SBATCH --output="$RUN_DIR/slurm/learner-%j.out" \
  "$HERE/poly_learner.sbatch" "$@")
learner=${learner%%;*}
# shellcheck disable=SC2086
clients=$(sbatch --parsable $CLIENTS_SBATCH --array="0-$((CLIENT_JOBS - 1))" \
  --dependency="after:$learner" --kill-on-invalid-dep=yes \
  --output="$RUN_DIR/slurm/env-clients-%A_%a.out" "$HERE/poly_env_clients.sbatch" "$@")
clients=${clients%%;*}
echo "learner job $learner, env client array job $clients; run dir $RUN_DIR"

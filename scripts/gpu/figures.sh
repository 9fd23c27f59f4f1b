#!/usr/bin/env bash
# The GPU throughput figures of docs/performance.md#measured-on-a-gpu-machine in one go, from the
# repo root of a GPU machine with PyTorch (about 8 minutes on 16 cores; ACTORS=15 about 6): first
# the raw env rate of Pong's engines on every core, a process a core (~30 s); then mono and poly
# with 8 and 15 actor processes (poly's server in the learner's one process, role=all's default);
# then at 15: poly with a GIL switch interval of 0.5 ms instead of Python's 5, poly with central
# inference's cap raised from 64 envs a batch to 256, poly with 4 server shards, and mono with 8
# envs an actor (auto gives 4 there; its actors' CPU inference costs less a step at a batch of 8).
# The likeliest gains come first, in case a lease runs out.
# Wheels in .whl/ (scripts/gpu/wheels.sh, for a machine with no package index) are installed first.
#   scripts/gpu/figures.sh                        # writes $OUT/figures.txt (default benchmarks/results/gpu)
#   ACTORS="2" SECONDS_EACH=10 scripts/gpu/figures.sh   # a quick try, on any machine
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu}
ACTORS=${ACTORS:-"8 15"}
SECONDS_EACH=${SECONDS_EACH:-25}
WARMUP=${WARMUP:-15}
mkdir -p "$OUT"
log="$OUT/figures.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# EnvPool unpacked and trimmed to travel (scripts/gpu/envpool_site.sh), where it came along.
if [ -d .devsite ]; then export PYTHONPATH="$PWD/.devsite${PYTHONPATH:+:$PYTHONPATH}"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$log"
import os, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"torch {torch.__version__}, {gpu}, {os.cpu_count()} cores")
PY
measure() {  # a title, then the throughput benchmark's arguments
  echo -e "\n== $1" | tee -a "$log"
  shift
  python3 benchmarks/throughput.py train --warmup "$WARMUP" --seconds "$SECONDS_EACH" "$@" logger.wandb.mode=disabled 2>&1 | tee -a "$log"
}
echo -e "\n== raw env rate, Pong, a process a core" | tee -a "$log"
python3 benchmarks/throughput.py envs --ids ALE/Pong-v5 --processes "$(nproc)" --seconds 3 --rounds 1 2>&1 \
  | grep -v "A.L.E\|Stella" | tee -a "$log"
for actors in $ACTORS; do
  measure "$actors actors" --backends mono poly "backend.num_actors=$actors"
done
last=${ACTORS##* }
measure "poly, $last actors, backend.gil_switch_interval_ms=0.5" --backends poly "backend.num_actors=$last" backend.gil_switch_interval_ms=0.5
measure "poly, $last actors, backend.max_batch_size=256" --backends poly "backend.num_actors=$last" backend.max_batch_size=256
measure "poly, $last actors, backend.server_shards=4" --backends poly "backend.num_actors=$last" backend.server_shards=4
measure "mono, $last actors x 8 envs" --backends mono "backend.num_actors=$last" backend.envs_per_actor=8

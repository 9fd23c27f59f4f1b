#!/usr/bin/env bash
# `make slurm-stop`: cancels the local cluster's jobs, then stops slurmd, slurmctld and munged by
# their pid files (never by process name), and removes the sacct that start.sh installed.
set -uo pipefail
RUN=/run/slurm
SACCT=/usr/local/bin/sacct
say() { echo "[slurm-stop] $*"; }

running() {  # not a zombie: an exited daemon can stay one until PID 1 reaps it
  local state
  state=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ $state != Z && $state != X ]]
}
stop() {  # stop PIDFILE COMM
  local pid
  pid=$(cat "$1" 2>/dev/null) || { say "$2: not running"; return 0; }
  if [[ ! $pid =~ ^[0-9]+$ || "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$2" ]] || ! running "$pid"; then
    say "$2: not running"; rm -f "$1"; return 0
  fi
  say "stopping $2 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then say "$2 still running after 10 s: KILL"; kill -KILL "$pid" 2>/dev/null; sleep 0.2; fi
  rm -f "$1"
}

# Jobs first, so that no job outlives slurmd.
if [[ -s $RUN/slurmctld.pid ]] && scontrol ping >/dev/null 2>&1; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u)
  if [[ -n $jobs ]]; then
    say "cancelling jobs:" $jobs
    scancel $jobs 2>/dev/null
    for _ in $(seq 100); do [[ -z $(squeue -h -o %A 2>/dev/null) ]] && break; sleep 0.2; done
  fi
fi
stop $RUN/slurmd.pid slurmd
stop $RUN/slurmctld.pid slurmctld
stop /run/munge/munged.pid munged
if [[ -f $SACCT ]] && grep -q "torchbeast_hydra local-cluster sacct" $SACCT; then rm -f $SACCT; fi
say "stopped"

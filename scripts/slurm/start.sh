#!/usr/bin/env bash
# `make slurm-start`: a single-node SLURM cluster (munged + slurmctld + slurmd) on this machine,
# without systemd, for trying SLURM launches on a workstation or in CI. Installs the Debian packages
# first if they are missing (root). Idempotent: a running, usable cluster is left as it is.
# One partition, $SLURM_PARTITION (default: debug), holding this node. Stop it with `make slurm-stop`.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PARTITION=${SLURM_PARTITION:-debug}
NODE=$(hostname -s)
WAIT_S=${SLURM_START_TIMEOUT:-60}
CONF=/etc/slurm/slurm.conf                  # the default path: sbatch, sinfo, ... need no SLURM_CONF
RUN=/run/slurm
LOGS=/var/log/slurm
MUNGE_PID=/run/munge/munged.pid
MUNGE_KEY=/etc/munge/munge.key
SACCT=/usr/local/bin/sacct                  # ahead of /usr/bin on PATH; see scripts/slurm/sacct

say() { echo "[slurm-start] $*"; }

"$HERE/install.sh"

# A daemon is up if its pid file names a live process of that name. Exited daemons can linger as
# zombies when PID 1 does not reap them (containers): state Z counts as dead.
alive() {  # alive PIDFILE COMM
  local pid state
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] || return 1
  state=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ $state != Z && $state != X ]]
}
node_state() { sinfo -h -n "$NODE" -o %t 2>/dev/null | head -n1; }
node_usable() { [[ $(node_state) =~ ^(idle|mix|alloc|comp)$ ]]; }
install_sacct() {
  if [[ ! -e $SACCT ]] || grep -q "torchbeast_hydra local-cluster sacct" "$SACCT"; then
    install -m 0755 "$HERE/sacct" "$SACCT"
  else
    say "warning: $SACCT exists and is not ours; leaving it (submitit needs a working sacct)"
  fi
}

if alive $MUNGE_PID munged && alive $RUN/slurmctld.pid slurmctld && alive $RUN/slurmd.pid slurmd \
   && scontrol ping >/dev/null 2>&1 && node_usable; then
  install_sacct
  say "already up: partition $(sinfo -h -o %R | head -n1), node $NODE $(node_state)"
  exit 0
fi

# munge: no systemd to create its runtime dir; munged runs as user munge.
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
if [[ ! -s $MUNGE_KEY ]]; then
  say "creating the munge key"
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=$MUNGE_KEY --force
  else dd if=/dev/urandom of=$MUNGE_KEY bs=1024 count=1 status=none; fi
fi
chown munge:munge $MUNGE_KEY && chmod 0400 $MUNGE_KEY
if ! alive $MUNGE_PID munged; then
  rm -f $MUNGE_PID
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged --force  # --force: a killed munged leaves its socket behind
fi
for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n </dev/null | unmunge >/dev/null || { say "munge does not work"; tail -n 20 /var/log/munge/munged.log; exit 1; }

# slurm.conf: the node as slurmd sees it (or the node drains on a mismatch), memory at 90%.
mkdir -p /etc/slurm $RUN $LOGS /var/spool/slurmctld /var/spool/slurmd
HW=$(slurmd -C | head -n1)
hw() { sed -n "s/.*\b$1=\([0-9]*\).*/\1/p" <<<"$HW"; }
CPUS=$(hw CPUs); MEM=$(hw RealMemory)
CPUS=${CPUS:-$(nproc)}; MEM=$(( ${MEM:-$(free -m | awk '/^Mem:/{print $2}')} * 90 / 100 ))
TOPOLOGY=$(grep -o 'Boards=[0-9]* SocketsPerBoard=[0-9]* CoresPerSocket=[0-9]* ThreadsPerCore=[0-9]*' <<<"$HW" || true)
NEW=$(mktemp)
cat >"$NEW" <<CONF
# written by torchbeast_hydra scripts/slurm/start.sh
ClusterName=local
# the host name may not resolve: address everything by loopback
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SchedulerType=sched/backfill
# CPUs are the consumable resource (memory is not): 1-CPU jobs run side by side
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
# no slurmdbd: job states come from slurmctld, which keeps finished jobs for a day (see sacct)
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=86400
# a preempted job gets its signal (submitit: SIGUSR2) before it is requeued
SlurmctldParameters=preempt_send_user_signal
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} ${TOPOLOGY} RealMemory=${MEM} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
if ! cmp -s "$NEW" $CONF; then say "writing $CONF"; install -m 0644 "$NEW" $CONF; fi
rm -f "$NEW"

if ! alive $RUN/slurmctld.pid slurmctld; then
  rm -f $RUN/slurmctld.pid
  say "starting slurmctld"
  slurmctld -c   # -c: a clean state, no jobs or node states from an earlier cluster
fi
for _ in $(seq $((WAIT_S * 5))); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
scontrol ping >/dev/null 2>&1 || { say "slurmctld does not answer"; tail -n 30 $LOGS/slurmctld.log; exit 1; }

if ! alive $RUN/slurmd.pid slurmd; then
  rm -f $RUN/slurmd.pid
  say "starting slurmd"
  slurmd -N "$NODE"
fi
resumed=0
for _ in $(seq $((WAIT_S * 5))); do
  node_usable && break
  # DOWN clears on registration (ReturnToService=2); DRAIN never clears by itself: resume once.
  if [[ $resumed == 0 && $(node_state) =~ ^(drain|drng|drained|fail|failg) ]]; then
    say "node $NODE is $(node_state) ($(sinfo -h -n "$NODE" -o %E)): resuming it"
    scontrol update NodeName="$NODE" State=RESUME || true
    resumed=1
  fi
  sleep 0.2
done
if ! node_usable; then
  say "node $NODE did not become usable (state: $(node_state))"
  scontrol show node "$NODE" || true
  tail -n 30 $LOGS/slurmctld.log $LOGS/slurmd.log || true
  exit 1
fi
install_sacct
say "up: partition $PARTITION, node $NODE ($CPUS CPUs) $(node_state)"

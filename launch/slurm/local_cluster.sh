#!/bin/bash
# Start (or stop) a single-node SLURM cluster on this machine, for tests, CI and trying the
# sbatch scripts. Needs Debian's slurmctld, slurmd, slurm-client and munge, and root.
#   source <(launch/slurm/local_cluster.sh start)   # prints `export SLURM_CONF=...`
#   launch/slurm/local_cluster.sh stop
set -euo pipefail
DIR="${LOCAL_SLURM_DIR:-/tmp/lowprec-slurm}"
CMD="${1:-start}"
HOST="$(hostname -s)"

stop() {
  pkill -x slurmctld 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
}

if [ "$CMD" = stop ]; then stop; exit 0; fi

for b in slurmctld slurmd sbatch munged; do
  command -v "$b" >/dev/null || { echo "local_cluster.sh: '$b' not found; apt-get install slurmd slurmctld slurm-client munge" >&2; exit 1; }
done
mkdir -p "$DIR"/{spool,state,log}

# munge: a key, and the daemon running as its own user.
if ! pgrep -x munged >/dev/null; then
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
  chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
fi

CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat > "$DIR/slurm.conf" <<CONF
ClusterName=lowprec-local
SlurmctldHost=${HOST}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool
SlurmctldPidFile=${DIR}/slurmctld.pid
SlurmdPidFile=${DIR}/slurmd.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=${HOST} CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN
PartitionName=local Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF="$DIR/slurm.conf"
stop
sleep 0.5
slurmctld -c -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 60); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.5
done
echo "local_cluster.sh: the node did not come up; see $DIR/log" >&2
exit 1

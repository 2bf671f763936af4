#!/bin/bash
# Start (or stop) a local SLURM cluster on this machine, for tests, CI and trying the sbatch
# scripts. Needs Debian's slurmctld, slurmd, slurm-client and munge, and root.
#
#   source <(launch/slurm/local_cluster.sh start)     # one node: this host
#   source <(launch/slurm/local_cluster.sh start 2)   # two nodes, node0 and node1, each its own host
#   ip netns exec "$LOCAL_SLURM_NETNS" sbatch -N 2 launch/slurm/pretrain.sbatch ...
#   launch/slurm/local_cluster.sh stop
#
# With NODES >= 2 every node is a network namespace with its own hostname (a UTS namespace), its
# own address (10.77.0.1, 10.77.0.2, ... on a veth joined by a bridge in one more namespace) and its
# own slurmd; slurmctld runs on node0. Nothing is reachable from outside the namespaces: submit
# from inside node0's (`start` prints LOCAL_SLURM_NETNS).
# Everything the cluster needs lives in $LOCAL_SLURM_DIR (default /tmp/lowprec-slurm): slurm.conf,
# state, spool, logs, pid files and its own munged (key and socket). `stop` ends the daemons it
# started (by their pid files) and whatever still runs in its namespaces, then deletes the
# namespaces; the directory's logs are left for reading.
set -euo pipefail
DIR="${LOCAL_SLURM_DIR:-/tmp/lowprec-slurm}"
CMD="${1:-start}"
NODES="${2:-1}"
# namespace names are global to the machine: derive them from the directory, so two clusters
# (two directories) never share one
NS="lps$(printf '%s' "$DIR" | md5sum | cut -c1-6)"
SUBNET=10.77.0

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

kill_pidfile() {  # kill_pidfile FILE: TERM the process it names, wait up to 5 s, then KILL
  local pid
  [ -s "$1" ] || return 0
  pid=$(cat "$1")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

stop() {
  local f ns
  for f in "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd-*.pid "$DIR"/munge/munged.pid; do
    [ -e "$f" ] && kill_pidfile "$f"
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS}(hub|[0-9]+)$" || true); do
    # job steps the daemons left behind (slurmstepd, torchrun, workers): only those in our namespaces
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns delete "$ns" 2>/dev/null || true
  done
  rm -rf "$DIR"/run "$DIR"/munge/etc/munged.seed
}

if [ "$CMD" = stop ]; then stop; exit 0; fi
[ "$CMD" = start ] || die "unknown command '$CMD': use start [NODES] or stop"
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] || die "NODES '$NODES': must be a number of nodes from 1 to 99"
[ "$(id -u)" = 0 ] || die "needs root (daemons, and network namespaces for NODES >= 2)"
for b in slurmctld slurmd sbatch munged; do
  command -v "$b" >/dev/null || die "'$b' not found; apt-get install slurmd slurmctld slurm-client munge"
done
if [ "$NODES" -gt 1 ]; then command -v ip >/dev/null || die "'ip' not found; apt-get install iproute2"; fi
stop
mkdir -p "$DIR"/{spool,state,log,run,munge/etc}

# munge: a key and a daemon of this cluster's own. munged wants its socket's directory (and every
# directory above it) searchable by all, and its key private.
chmod 755 "$DIR" "$DIR/munge"
chmod 700 "$DIR/munge/etc"
[ -s "$DIR/munge/etc/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/etc/munge.key" bs=1024 count=1 status=none
chmod 400 "$DIR/munge/etc/munge.key"
SOCKET="$DIR/munge/munge.socket"
munged --socket="$SOCKET" --key-file="$DIR/munge/etc/munge.key" --pid-file="$DIR/munge/munged.pid" \
  --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/etc/munged.seed" \
  || die "munged did not start; see $DIR/log/munged.log"

CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
if [ "$NODES" = 1 ]; then
  HEAD="$(hostname -s)"
  NODE_LINES="NodeName=${HEAD} CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN"
  NODE_LIST="$HEAD"
  CTLD_HOST="$HEAD"
else
  HEAD=node0
  NODE_LINES=""
  for i in $(seq 0 $((NODES - 1))); do
    NODE_LINES+="NodeName=node$i NodeAddr=${SUBNET}.$((i + 1)) CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN"$'\n'
  done
  NODE_LIST="node[0-$((NODES - 1))]"
  CTLD_HOST="node0(${SUBNET}.1)"
fi
# %n: each slurmd (-N NAME) keeps its own spool, pid file and log
cat > "$DIR/slurm.conf" <<CONF
ClusterName=lowprec-local
SlurmctldHost=${CTLD_HOST}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=${SOCKET}
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool/%n
SlurmctldPidFile=${DIR}/run/slurmctld.pid
SlurmdPidFile=${DIR}/run/slurmd-%n.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
${NODE_LINES}
PartitionName=local Nodes=${NODE_LIST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF="$DIR/slurm.conf"

if [ "$NODES" = 1 ]; then
  mkdir -p "$DIR/spool/$HEAD"
  slurmctld -c -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  RUN_IN=()
else
  # the network: node i's eth0 (SUBNET.i+1/24) -- veth -- v$i on bridge br0 in the hub namespace
  ip netns add "${NS}hub"
  ip -n "${NS}hub" link add br0 type bridge
  ip -n "${NS}hub" link set br0 up
  for i in $(seq 0 $((NODES - 1))); do
    ip netns add "${NS}$i"
    ip -n "${NS}$i" link set lo up
    ip -n "${NS}$i" link add eth0 type veth peer name "v$i" netns "${NS}hub"
    ip -n "${NS}$i" addr add "${SUBNET}.$((i + 1))/24" dev eth0
    ip -n "${NS}$i" link set eth0 up
    ip -n "${NS}hub" link set "v$i" master br0 up
  done
  # each daemon in its node's network namespace, under the node's own hostname (slurmctld checks
  # its hostname against SlurmctldHost; jobs see the name they run on). nsenter, not `ip netns
  # exec`: that one mounts a fresh /sys, without the cgroup tree slurmd needs.
  on_node() { local i=$1; shift; nsenter --net="/run/netns/${NS}$i" unshare --uts sh -c "hostname node$i && exec $*"; }
  on_node 0 slurmctld -c -f "'$SLURM_CONF'"
  for i in $(seq 0 $((NODES - 1))); do
    mkdir -p "$DIR/spool/node$i"
    on_node "$i" slurmd -f "'$SLURM_CONF'" -N "node$i"
  done
  RUN_IN=(ip netns exec "${NS}0")
fi
for _ in $(seq 1 60); do
  if [ "$("${RUN_IN[@]}" sinfo -h -o '%t %D' 2>/dev/null | awk '$1 ~ /^(idle|mix|alloc)$/ {n += $2} END {print n + 0}')" = "$NODES" ]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    [ "$NODES" = 1 ] || echo "export LOCAL_SLURM_NETNS=${NS}0"
    exit 0
  fi
  sleep 0.5
done
die "$NODES node(s) did not come up within 30 s; see $DIR/log"

#!/usr/bin/env bash
# A real Slurm (Debian's slurmctld + slurmd + munge) emulating NODES nodes on this one host,
# for as long as COMMAND runs:
#
#   launch/slurm_emulation/cluster.sh [--nodes N] [--dir DIR] [--keep] -- COMMAND [ARGS...]
#
# COMMAND runs with SLURM_CONF set, so sbatch/srun/squeue/scontrol talk to this cluster, and
# RAYLESS_SLURM_DIR naming the scratch folder. Its exit status is this script's. Needs root
# (mount and UTS namespaces, daemons as root) and the packages (ensure_packages.sh).
#
# How one host passes for N nodes (docs/slurm.md has the why of each):
# - one `slurmd -N nodeK` per node, each on its own port, declared at loopback address
#   127.0.0.(10+K) with 96 CPUs and 8 GPUs (placeholder device files in gres.conf), so a
#   script written for real nodes (--gpus-per-node=8 --cpus-per-task=96 --exclusive) is
#   accepted as it is;
# - everything runs in a private mount namespace in which a copy of /etc/hosts that names
#   nodeK is bind-mounted over /etc/hosts: job steps resolve node names, the system's file is
#   untouched;
# - each slurmd runs in its own UTS namespace whose hostname is nodeK, so a job step on nodeK
#   sees `hostname` = nodeK as on a real cluster (torchrun's c10d rendezvous decides which
#   agent hosts the store by comparing the endpoint with the hostname; srun's %N names files);
# - and a PID namespace whose init is this script: when it ends, the kernel ends whatever is
#   left (a step that outlived scancel), so nothing survives even a failed or killed run.
#   Daemons are stopped by the PIDs recorded at start before that.
# Every file (config, keys, sockets, state, spool, logs) lives under the scratch folder DIR
# (default: a fresh mktemp -d, removed after a successful run unless --keep).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODES=4
DIR=""
KEEP=0
while (($#)); do
  case $1 in
    --nodes) NODES=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --inside) INSIDE=1; shift ;;  # internal: we are the namespace's init
    --) shift; break ;;
    *) echo "cluster.sh: unknown option $1 (usage: cluster.sh [--nodes N] [--dir DIR] [--keep] -- COMMAND)" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "cluster.sh: no COMMAND given" >&2; exit 2; }
((NODES >= 1 && NODES <= 200)) || { echo "cluster.sh: --nodes must be 1..200" >&2; exit 2; }

if [[ -z ${INSIDE:-} ]]; then
  [[ $(id -u) == 0 ]] || { echo "cluster.sh: needs root (namespaces, Slurm daemons as root)" >&2; exit 2; }
  for tool in slurmctld slurmd munged sbatch unshare; do
    command -v "$tool" >/dev/null || { echo "cluster.sh: $tool missing (run $HERE/ensure_packages.sh)" >&2; exit 2; }
  done
  if [[ -z $DIR ]]; then DIR=$(mktemp -d "${TMPDIR:-/tmp}/rayless-slurm.XXXXXX"); else mkdir -p "$DIR"; fi
  DIR=$(cd "$DIR" && pwd)
  # -m: private /etc/hosts; -p --fork --mount-proc: the PID namespace (and a /proc that
  # shows only its processes, which proctrack/linuxproc reads).
  code=0
  # --kill-child: if this script is killed, the namespace's init still gets SIGTERM and cleans up.
  unshare -m --propagation private -p --fork --kill-child=TERM --mount-proc \
    "$0" --inside --nodes "$NODES" --dir "$DIR" -- "$@" || code=$?
  if ((code == 0 && !KEEP)); then rm -rf "$DIR"; else echo "cluster.sh: scratch folder kept: $DIR" >&2; fi
  exit $code
fi

# ---- inside the namespaces: this shell is PID 1 of its PID namespace.
mkdir -p "$DIR"/{etc,munge,state,spool,log,run,gpu}
PIDS=()      # every daemon we started, stopped in reverse order
NAMES=()

stop_all() {
  # Jobs first, so slurmd can end their steps cleanly; then the daemons, newest first.
  if [[ -n ${SLURM_CONF:-} ]] && [[ -n ${PIDS[*]:-} ]]; then
    scancel --quiet --user="$(id -un)" 2>/dev/null || true  # our private cluster's jobs only
    for _ in $(seq 40); do
      [[ -z $(squeue --noheader --states=PENDING,RUNNING,COMPLETING 2>/dev/null) ]] && break
      sleep 0.5
    done
  fi
  local i pid
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    pid=${PIDS[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then
      echo "cluster.sh: ${NAMES[i]} (pid $pid) ignored SIGTERM for 5 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() {  # start NAME CMD...: runs CMD (a foreground daemon) in the background, records its PID
  local name=$1; shift
  "$@" >"$DIR/log/$name.stdout" 2>&1 &
  PIDS+=($!)
  NAMES+=("$name")
}

free_ports() {  # free_ports N: N TCP ports free right now on 127.0.0.1
  python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

alive() {  # alive PID: running (kill -0 alone also succeeds on a zombie we have not reaped yet)
  [[ -r /proc/$1/stat ]] && [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]
}

node_addr() { echo "127.0.0.$((10 + $1))"; }

# ---- names: a private /etc/hosts (the system's entries plus ours)
cp /etc/hosts "$DIR/etc/hosts"
for ((k = 1; k <= NODES; k++)); do echo "$(node_addr $k) node$k" >>"$DIR/etc/hosts"; done
mount --bind "$DIR/etc/hosts" /etc/hosts

# ---- munge: a generated key, everything in $DIR/munge (munged wants 0700/0755 dirs, a 0400 key)
chmod 755 "$DIR" "$DIR/munge"
head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
chmod 400 "$DIR/munge/munge.key"
SOCKET=$DIR/munge/munge.socket
start munged munged --foreground --force --socket="$SOCKET" --key-file="$DIR/munge/munge.key" \
  --log-file="$DIR/log/munged.log" --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/seed"
for _ in $(seq 50); do [[ -S $SOCKET ]] && break; sleep 0.1; done
[[ -S $SOCKET ]] || { echo "cluster.sh: munged did not start; see $DIR/log/munged.log" >&2; exit 1; }

# ---- Slurm's configuration
read -r CTLD_PORT NODE_PORTS <<<"$(free_ports $((NODES + 1)))"
read -r -a NODE_PORTS <<<"$NODE_PORTS"
for ((g = 0; g < 8; g++)); do : >"$DIR/gpu/gpu$g"; done
export SLURM_CONF=$DIR/etc/slurm.conf
cat >"$SLURM_CONF" <<EOF
# Written by launch/slurm_emulation/cluster.sh: $NODES emulated nodes on one host.
ClusterName=rayless-emulated
SlurmctldHost=controller(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# No cgroups in a container: track processes through /proc, bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# The declared CPUs and GPUs below win over what slurmd finds on this 2-core host.
SlurmdParameters=config_overrides
GresTypes=gpu
# Finished jobs stay visible to scontrol for 10 minutes (tests read their state).
MinJobAge=600
KillWait=10
EOF
for ((k = 1; k <= NODES; k++)); do
  echo "NodeName=node$k NodeAddr=$(node_addr $k) NodeHostname=node$k Port=${NODE_PORTS[k - 1]} CPUs=96 Gres=gpu:8 State=UNKNOWN" >>"$SLURM_CONF"
done
echo "PartitionName=emulated Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >>"$SLURM_CONF"
# Placeholder device files: a GPU count without files makes the nodes drain.
echo "AutoDetect=off" >"$DIR/etc/gres.conf"
echo "NodeName=node[1-$NODES] Name=gpu File=$DIR/gpu/gpu[0-7]" >>"$DIR/etc/gres.conf"

# ---- daemons
# slurmctld insists that its hostname is the SlurmctldHost's name: give it a UTS namespace too.
start slurmctld unshare -u sh -c "hostname controller && exec slurmctld -D -i -f '$SLURM_CONF'"
for ((k = 1; k <= NODES; k++)); do
  # unshare -u without --fork execs in place, and sh execs slurmd: the recorded PID is slurmd's.
  start "slurmd-node$k" unshare -u sh -c "hostname node$k && exec slurmd -D -N node$k -f '$SLURM_CONF'"
done

# Up when every node is idle (sinfo answers once slurmctld listens; nodes register within ~1 s).
for _ in $(seq 120); do
  idle=$( (sinfo --noheader --states=idle --format=%D 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
  ((idle == NODES)) && break
  for i in "${!PIDS[@]}"; do
    alive "${PIDS[i]}" || { echo "cluster.sh: ${NAMES[i]} exited at start; see $DIR/log/" >&2; tail -n 20 "$DIR/log/${NAMES[i]}"* >&2 || true; exit 1; }
  done
  sleep 0.5
done
((idle == NODES)) || { echo "cluster.sh: only $idle of $NODES nodes idle after 60 s" >&2; sinfo >&2 || true; exit 1; }
echo "cluster.sh: $NODES nodes up (node1..node$NODES at $(node_addr 1)..$(node_addr "$NODES")), SLURM_CONF=$SLURM_CONF" >&2

export RAYLESS_SLURM_DIR=$DIR
code=0
"$@" || code=$?
exit $code

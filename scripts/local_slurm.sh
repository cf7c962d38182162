#!/usr/bin/env bash
# A single-node SLURM on this machine, to try `brats-swap cv submit slurm` and to test it (CI does).
#
#   sudo scripts/local_slurm.sh start   # install (Debian/Ubuntu: slurm-wlm, munge) if missing, start, wait
#   sudo scripts/local_slurm.sh stop    # stop the daemons this script started
#   scripts/local_slurm.sh status       # sinfo, or exit 1 when it is not running
#
# munged, slurmctld and slurmd run on localhost as root, without systemd: one node with this machine's CPUs
# in a `debug` partition; ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups needed, so
# it works in a container). Requeued jobs may start again after 5 s (AuthInfo cred_expire), not 2 minutes.
# Idempotent: `start` on a running SLURM only checks it.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurm-local
LOG_DIR=/var/log/slurm-local
RUN_DIR=/run/slurm-local

log() { echo "local_slurm: $*" >&2; }

running() { sinfo -h -o %T >/dev/null 2>&1 && [ -n "$(sinfo -h -o %T 2>/dev/null | grep -E '^(idle|mixed|allocated)' || true)" ]; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null; then
        return
    fi
    log "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

write_config() {
    local host cpus memory
    host=$(hostname -s)
    cpus=$(nproc)
    memory=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/d" "$LOG_DIR" "$RUN_DIR"
    cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by brats-swap's scripts/local_slurm.sh: a single-node SLURM for trying and testing.
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Schedule every second (defaults: 60 s, backfill 30 s): a requeued job starts again within seconds.
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

# The daemons this script started, one name a line: `stop` stops those only (not a munged the system runs).
STARTED=$RUN_DIR/started

start_munge() {
    if pgrep -x munged >/dev/null; then
        return
    fi
    echo munged >>"$STARTED"
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    if id munge >/dev/null 2>&1; then
        chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
        chmod 0400 /etc/munge/munge.key
        runuser -u munge -- /usr/sbin/munged
    else
        chmod 0400 /etc/munge/munge.key
        /usr/sbin/munged --force
    fi
}

start() {
    if [ "$(id -u)" != 0 ]; then
        log "start needs root (it installs packages and starts daemons)"
        exit 1
    fi
    install_packages
    if running; then
        log "already running"; sinfo; return
    fi
    write_config
    start_munge
    if ! pgrep -x slurmctld >/dev/null; then
        slurmctld -c   # -c: a clean state, no jobs from an earlier start
        echo slurmctld >>"$STARTED"
    fi
    if ! pgrep -x slurmd >/dev/null; then
        slurmd
        echo slurmd >>"$STARTED"
    fi
    local deadline=$((SECONDS + 60))
    until running; do
        if [ $SECONDS -ge $deadline ]; then
            log "SLURM did not come up within 60 s; logs:"
            tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
            exit 1
        fi
        sleep 0.5
    done
    log "running (node $(hostname -s), $(nproc) CPUs, partition debug)"
    sinfo
}

stop_daemon() {
    local name=$1 pidfile=$2 pid
    grep -qx "$name" "$STARTED" 2>/dev/null || return 0
    pid=$(cat "$pidfile" 2>/dev/null || pgrep -x "$name" || true)
    [ -n "$pid" ] || return 0
    kill $pid 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 $pid 2>/dev/null || return 0
        sleep 0.2
    done
    kill -9 $pid 2>/dev/null || true
}

stop() {
    # Jobs first, so that nothing the daemons started keeps running.
    if running; then
        scancel --full --quiet "--user=$(id -un)" 2>/dev/null || true
    fi
    stop_daemon slurmd "$RUN_DIR/slurmd.pid"
    stop_daemon slurmctld "$RUN_DIR/slurmctld.pid"
    stop_daemon munged /run/munge/munged.pid
    rm -f "$STARTED"
    log "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) running && sinfo ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac

#!/bin/bash
# slurm_up.sh - a real single-node Slurm (slurmctld + slurmd + munged) for spswap's tests
# and for trying spswap on one machine. Debian/Ubuntu, run as root, no systemd needed.
#
#   scripts/slurm_up.sh [up]    install what is missing, configure, start, wait until idle
#   scripts/slurm_up.sh down    cancel every job, stop the daemons (and munged we started)
#
# Re-running "up" restarts the cluster with a fresh configuration and no jobs.
#
# Environment (all optional):
#   SLURM_CI_DIR   state, spool, logs and fake GPU devices      (default /tmp/spswap-slurm)
#   FAKE_GPUS      fake GPUs exposed as GRES gpu (char devices)  (default 2; 0 = none)
#   SLURM_PROLOG   Prolog script (absolute after resolution)     (default <repo>/slurm/prolog.sh)
#   SLURM_EPILOG   Epilog script                                 (default <repo>/slurm/epilog.sh)
#                  set either to "none" to run without it
#   SPSWAP_BIN     the spswap executable the prolog/epilog run; written to /etc/default/spswap
#   SPSWAP_ROOT    spswap's root for the prolog/epilog (also written to /etc/default/spswap)
#   SPSWAP_SWEEP_INTERVAL_S  spswapd's sweep for ended jobs' images (written there too)
#   SLURM_UP_DEFAULTS_FILE   where that settings file goes (default /etc/default/spswap)
#   PROCTRACK      cgroup | linuxproc   (default cgroup, what docs/slurm.md recommends,
#                  where Slurm 22.05 can use it here: a cgroup v1 freezer, or cgroup v2;
#                  else linuxproc)
#   TASK_PLUGIN    task/cgroup | task/none   (default task/cgroup with PROCTRACK=cgroup)
#   CONSTRAIN_DEVICES yes | no: cgroup.conf's ConstrainDevices  (default no; needs
#                  PROCTRACK=cgroup and TASK_PLUGIN=task/cgroup)
#   REAL_GPUS      1: the node's /dev/nvidia[0-9]* as GRES gpu (a GPU machine; FAKE_GPUS
#                  is then ignored). Each GPU, fake or real, also has 4 GRES shards (the
#                  guide's GresTypes=gpu,shard), and SPSWAP_GPUS names the fake ones in
#                  /etc/default/spswap (spswapd finds real ones by NVML or /dev/nvidiaN)
#   GRACE_TIME     GraceTime in seconds of the preemptable "low" partition (default 10)
#   IDLE_TIMEOUT_S seconds to wait for the node to become idle   (default 60)
#   SLURMD_DEBUG   slurmd's log level (default info; debug shows each job's end and
#                  epilog steps with their times)
#   SLURMCTLD_DEBUG slurmctld's log level (default info; debug2 shows why the main
#                  scheduler passed a pending job by)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SLURM_CI_DIR=${SLURM_CI_DIR:-/tmp/spswap-slurm}
FAKE_GPUS=${FAKE_GPUS:-2}
cgroup_usable() {  # what Slurm 22.05's proctrack/cgroup needs, without systemd
    [ -e /sys/fs/cgroup/freezer/cgroup.procs ] || [ -f /sys/fs/cgroup/cgroup.controllers ]
}
if [ -z "${PROCTRACK:-}" ]; then
    if cgroup_usable; then PROCTRACK=cgroup; else PROCTRACK=linuxproc; fi
fi
if [ -z "${TASK_PLUGIN:-}" ]; then
    if [ "$PROCTRACK" = cgroup ]; then TASK_PLUGIN=task/cgroup; else TASK_PLUGIN=task/none; fi
fi
CONSTRAIN_DEVICES=${CONSTRAIN_DEVICES:-no}
REAL_GPUS=${REAL_GPUS:-0}
GRACE_TIME=${GRACE_TIME:-10}
IDLE_TIMEOUT_S=${IDLE_TIMEOUT_S:-60}
SLURM_PROLOG=${SLURM_PROLOG:-$REPO/slurm/prolog.sh}
SLURM_EPILOG=${SLURM_EPILOG:-$REPO/slurm/epilog.sh}
DEFAULTS_FILE=${SLURM_UP_DEFAULTS_FILE:-/etc/default/spswap}
DEFAULTS_MARK="# written by spswap scripts/slurm_up.sh"
WRITTEN_COPY="$SLURM_CI_DIR/spswap-defaults.written"  # the file as this script last wrote it

say() { echo "[slurm_up] $*"; }
die() { echo "slurm_up: $*" >&2; exit 1; }
pid_of() { cat "$SLURM_CI_DIR/$1.pid" 2>/dev/null || true; }
running() { local p; p=$(pid_of "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }
wait_gone() {  # pid, tries of 0.2 s
    local i; for ((i = 0; i < $2; i++)); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done
    return 1
}

stop_cluster() {
    local ctld slurmd pid exe
    # slurmd removes its pid file when shutdown begins: read both first
    ctld=$(pid_of slurmctld); slurmd=$(pid_of slurmd)
    if [ -n "$ctld" ] && kill -0 "$ctld" 2>/dev/null; then
        # A slurmd shut down while a job was completing stayed behind ignoring SIGTERM:
        # empty the queue first.
        timeout 10 squeue -h -o %A 2>/dev/null | xargs -r timeout 10 scancel 2>/dev/null || true
        for _ in $(seq 1 100); do
            [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && break
            sleep 0.2
        done
        timeout 10 scontrol shutdown >/dev/null 2>&1 || true
    fi
    for pid in $ctld $slurmd; do
        wait_gone "$pid" 50 && continue
        kill -TERM "$pid" 2>/dev/null || true
        wait_gone "$pid" 25 || kill -KILL "$pid" 2>/dev/null || true
    done
    for pid in /proc/[0-9]*; do   # this cluster's step daemons left by an unclean stop
        exe=$(readlink "$pid/exe" 2>/dev/null || true)
        case "$exe" in */slurmstepd) ;; *) continue ;; esac
        ours_stepd "$pid" && kill -KILL "${pid#/proc/}" 2>/dev/null || true
    done
}

# A slurmstepd of this cluster, not another Slurm's on the host: it holds a file under
# our state directory (slurmd's log, which every step daemon inherits and writes to).
ours_stepd() {
    local fd
    for fd in "$1"/fd/*; do
        case "$(readlink "$fd" 2>/dev/null)" in "$SLURM_CI_DIR"/*) return 0 ;; esac
    done
    return 1
}

if [ "${1:-up}" = down ]; then
    stop_cluster
    if [ -f "$SLURM_CI_DIR/munged.ours" ] && [ -s /run/munge/munged.pid ]; then
        kill -TERM "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$SLURM_CI_DIR/munged.ours"
    fi
    if [ -f "$DEFAULTS_FILE" ] && grep -qF "$DEFAULTS_MARK" "$DEFAULTS_FILE"; then
        # only as written: an admin's edits stay (the next `up` writes it again)
        if cmp -s "$DEFAULTS_FILE" "$WRITTEN_COPY"; then
            rm -f "$DEFAULTS_FILE"
        else
            say "kept $DEFAULTS_FILE: it was edited after this script wrote it (remove it yourself)"
        fi
    fi
    say "stopped"
    exit 0
fi
[ "${1:-up}" = up ] || die "unknown command '$1': use 'up' or 'down'"
[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts slurmd)"
START_S=$SECONDS

# -- packages -------------------------------------------------------------------------
need=()
for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || need+=("$cmd"); done
if [ ${#need[@]} -gt 0 ]; then
    say "installing slurmctld slurmd slurm-client munge (missing: ${need[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi
say "$(slurmctld -V), $(munged -V 2>&1 | head -1)"

# -- configuration --------------------------------------------------------------------
# (every refusal comes before anything is written or started: a refused run leaves the
# running test cluster, its jobs and the node's files as they were; then munged is started
# where none answers, and a munge that does not work stops the run before any file below)
HOST=$(hostname -s)
MEM_MB=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')

resolve_hook() {  # "none" -> nothing; else an absolute, executable path
    [ "$1" = none ] && return 0
    local path; path=$(readlink -f "$1") || die "cannot resolve $1"
    [ -x "$path" ] || die "$path is not an executable file (chmod +x it)"
    echo "$path"
}
PROLOG=$(resolve_hook "$SLURM_PROLOG")
EPILOG=$(resolve_hook "$SLURM_EPILOG")

# The prolog runs with no PATH: tell it where spswap is.
FAKE_GPU_LIST=$(seq -s, 0 $((FAKE_GPUS - 1)))  # SPSWAP_GPUS for the fake GPUs ("0,1")
if [ -n "${SPSWAP_BIN:-}${SPSWAP_ROOT:-}" ] && [ -f "$DEFAULTS_FILE" ]; then  # to be written
    if ! grep -qF "$DEFAULTS_MARK" "$DEFAULTS_FILE"; then
        die "$DEFAULTS_FILE exists and was not written by this script: move it aside (mv $DEFAULTS_FILE $DEFAULTS_FILE.site) and run this again to have the test cluster's written, or leave out SPSWAP_BIN and SPSWAP_ROOT and keep yours (it must name SPSWAP_BIN, and SPSWAP_GPUS=$FAKE_GPU_LIST for this test cluster's fake GPUs)"
    fi
    # (a walk's edit, SPSWAP_KEEP_BYTES, was written over without a word)
    if [ -f "$WRITTEN_COPY" ] && ! cmp -s "$DEFAULTS_FILE" "$WRITTEN_COPY"; then
        die "$DEFAULTS_FILE was edited after this script wrote it ($(diff "$WRITTEN_COPY" "$DEFAULTS_FILE" | sed -n 's/^> //p' | paste -sd' ' -)): run this again without SPSWAP_BIN and SPSWAP_ROOT to keep it as it is, or remove it (rm $DEFAULTS_FILE) to have it written again; a changed setting needs no re-run, only a restart of spswapd (spswap daemon stop; spswap daemon start)"
    fi
fi
real=()
if [ "$REAL_GPUS" = 1 ]; then
    mapfile -t real < <(ls /dev/nvidia[0-9]* 2>/dev/null | grep -E '/nvidia[0-9]+$' | sort -V)
    [ ${#real[@]} -gt 0 ] || die "REAL_GPUS=1 but no /dev/nvidia[0-9]* on this machine"
fi

# -- munge ----------------------------------------------------------------------------
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
mkdir -p "$SLURM_CI_DIR"
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged   # daemonizes itself
    touch "$SLURM_CI_DIR/munged.ours"
    for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || die "munge does not work: see /var/log/munge/munged.log"

# -- files -----------------------------------------------------------------------------
mkdir -p "$SLURM_CI_DIR"/{state,spool,log,dev}
if [ -n "${SPSWAP_BIN:-}${SPSWAP_ROOT:-}" ]; then
    was=$(cat "$DEFAULTS_FILE" 2>/dev/null || true)
    {
        echo "$DEFAULTS_MARK"
        [ -n "${SPSWAP_BIN:-}" ] && echo "SPSWAP_BIN=$SPSWAP_BIN"
        [ -n "${SPSWAP_ROOT:-}" ] && echo "SPSWAP_ROOT=$SPSWAP_ROOT"
        [ -n "${SPSWAP_SWEEP_INTERVAL_S:-}" ] && echo "SPSWAP_SWEEP_INTERVAL_S=$SPSWAP_SWEEP_INTERVAL_S"
        # fake GPUs are not /dev/nvidiaN: name them (as the guide does for nodes without NVML)
        if [ "$REAL_GPUS" != 1 ] && [ "$FAKE_GPUS" -gt 0 ]; then
            echo "SPSWAP_GPUS=$FAKE_GPU_LIST"
        fi
        true
    } > "$DEFAULTS_FILE"
    cp "$DEFAULTS_FILE" "$WRITTEN_COPY"  # what `down` may remove, and `up` write again
    # (a newcomer's walk: nothing said where spswap's settings for the prolog went)
    say "wrote $DEFAULTS_FILE ($(grep -v '^#' "$DEFAULTS_FILE" | paste -sd' ' -)): spswap's settings for the prolog, epilog and spswapd; \`$0 down\` removes it unless edited"
    # spswapd reads the file at its start only: a running one keeps the settings it read
    # (asked at the root the old file named: the one whose daemon may run)
    old_root=$(sed -n 's/^SPSWAP_ROOT=//p' <<<"$was" | tail -n 1)
    old_root=${old_root:-${SPSWAP_ROOT:-/dev/shm/spswap}}
    if [ "$was" != "$(cat "$DEFAULTS_FILE")" ] && [ -n "${SPSWAP_BIN:-}" ] &&
        SPSWAP_ROOT=$old_root "$SPSWAP_BIN" daemon status >/dev/null 2>&1; then
        at=""  # the old root named only where the new file names another
        [ "$old_root" != "${SPSWAP_ROOT:-/dev/shm/spswap}" ] && at="SPSWAP_ROOT=$old_root "
        echo "note: spswapd of $old_root runs with the settings it read at its start, not" \
             "the new $DEFAULTS_FILE: restart it (${at}$SPSWAP_BIN daemon stop;" \
             "$SPSWAP_BIN daemon start; instances it keeps alive end, their images stay)" >&2
    fi
elif [ "$REAL_GPUS" != 1 ] && [ "$FAKE_GPUS" -gt 0 ] && [ -f "$DEFAULTS_FILE" ] &&
    ! grep -q '^SPSWAP_GPUS=' "$DEFAULTS_FILE"; then
    # the site's own file is kept: it must name the fake GPUs itself (not /dev/nvidiaN)
    echo "note: $DEFAULTS_FILE names no SPSWAP_GPUS, so spswapd sees no GPU (this test" \
         "cluster's are fake): add SPSWAP_GPUS=$FAKE_GPU_LIST to it" >&2
fi

GRES_NODE=""
GRES_TYPES=""
: > /etc/slurm/gres.conf
if [ "$REAL_GPUS" = 1 ]; then
    for dev in "${real[@]}"; do
        echo "NodeName=$HOST Name=gpu File=$dev"
        echo "NodeName=$HOST Name=shard Count=4 File=$dev"
    done > /etc/slurm/gres.conf
    GRES_NODE="Gres=gpu:${#real[@]},shard:$((4 * ${#real[@]}))"
    GRES_TYPES="GresTypes=gpu,shard"
elif [ "$FAKE_GPUS" -gt 0 ]; then
    # Slurm 22.05 drops file-less GPUs and ignores regular files: fake GPUs must be
    # character devices with the NVIDIA major number (195).
    for ((i = 0; i < FAKE_GPUS; i++)); do
        dev="$SLURM_CI_DIR/dev/nvidia$i"
        [ -c "$dev" ] || { rm -f "$dev"; mknod "$dev" c 195 "$i"; }
    done
    for ((i = 0; i < FAKE_GPUS; i++)); do
        echo "NodeName=$HOST Name=gpu File=$SLURM_CI_DIR/dev/nvidia$i"
        echo "NodeName=$HOST Name=shard Count=4 File=$SLURM_CI_DIR/dev/nvidia$i"
    done > /etc/slurm/gres.conf
    GRES_NODE="Gres=gpu:$FAKE_GPUS,shard:$((4 * FAKE_GPUS))"
    # (AccountingStorageTRES=gres/gpu is fatal without slurmdbd: not set)
    GRES_TYPES="GresTypes=gpu,shard"
fi
if [ "$PROCTRACK" = cgroup ]; then
    printf '%s\n' CgroupPlugin=autodetect ConstrainCores=no ConstrainRAMSpace=no \
        "ConstrainDevices=$CONSTRAIN_DEVICES" > /etc/slurm/cgroup.conf
    if [ ! -d /run/systemd/system ] && [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        # No systemd on cgroup v2: slurmd makes its own scope under system.slice, which
        # must exist with the controllers enabled down to it.
        echo IgnoreSystemd=yes >> /etc/slurm/cgroup.conf
        mkdir -p /sys/fs/cgroup/system.slice
        for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
            echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
            echo "+$c" > /sys/fs/cgroup/system.slice/cgroup.subtree_control 2>/dev/null || true
        done
    fi
fi

# -- start ----------------------------------------------------------------------------
if running slurmctld || running slurmd; then stop_cluster; fi
cat > /etc/slurm/slurm.conf <<EOF
# generated by spswap scripts/slurm_up.sh: a single-node test cluster
ClusterName=spswap-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire seconds (default 120, minimum 5)
AuthInfo=cred_expire=5
StateSaveLocation=$SLURM_CI_DIR/state
SlurmdSpoolDir=$SLURM_CI_DIR/spool
SlurmctldPidFile=$SLURM_CI_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_CI_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_CI_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_CI_DIR/log/slurmd.log
SlurmctldDebug=${SLURMCTLD_DEBUG:-info}
SlurmdDebug=${SLURMD_DEBUG:-info}
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=$TASK_PLUGIN
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
${PROLOG:+Prolog=$PROLOG}
${EPILOG:+Epilog=$EPILOG}
PrologFlags=Alloc
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# deliver the job's --signal (e.g. B:USR1) at preemption, before GraceTime's SIGTERM
SlurmctldParameters=preempt_send_user_signal
$GRES_TYPES
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$MEM_MB $GRES_NODE State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=low   Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME
PartitionName=high  Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF

# -- start and wait until the node is idle ----------------------------------------------
slurmctld -c   # -c: clean start, no jobs from an earlier run
slurmd
state=""
deadline=$((SECONDS + IDLE_TIMEOUT_S))
while [ $SECONDS -lt $deadline ]; do
    for d in slurmctld slurmd; do   # a fatal configuration error ends a daemon at once
        if ! running "$d"; then
            sleep 0.5
            running "$d" || { tail -n 20 "$SLURM_CI_DIR/log/$d.log" >&2; die "$d is not running"; }
        fi
    done
    state=$(timeout 5 sinfo -h -N -o %T 2>/dev/null | head -1 || true)
    [ "$state" = idle ] && break
    sleep 0.1
done
if [ "$state" != idle ]; then
    sinfo -N -o '%N %T %E' >&2 || true
    tail -n 30 "$SLURM_CI_DIR/log/slurmctld.log" "$SLURM_CI_DIR/log/slurmd.log" >&2 || true
    die "node $HOST not idle after ${IDLE_TIMEOUT_S}s (state '$state')"
fi
say "node $HOST idle after $((SECONDS - START_S)) s; prolog=${PROLOG:-none} epilog=${EPILOG:-none}"
sinfo

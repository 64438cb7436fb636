#!/usr/bin/env bash
# A real single-node Slurm on a GPU machine without internet or apt (the H200 device), set
# up the way docs/slurm.md tells a site to, with spswap installed for root's prolog and a
# normal user's jobs. Run as root from the project root, with the kits of
# scripts/gpu/kits.sh in .device/ (they travel with the call).
#
#   bash scripts/gpu/slurm_up.sh [up]   install, configure, start, wait until idle
#   bash scripts/gpu/slurm_up.sh down   cancel every job, stop Slurm and munged; unmount
#                                       spswap's root if `up` mounted it (its pool and images go)
#
# What "up" does:
#   - unpacks .device/slurmdebs/*.deb into /opt/slurmkit and copies into /usr only what is
#     missing: never `dpkg -x` a Debian 12 package into '/' on Ubuntu (its ./lib replaces
#     Ubuntu's /lib -> usr/lib link and every later link step fails, vLLM's Triton JIT too);
#   - installs spswap from this checkout into /opt/spswap (src/, venv/ whose interpreter
#     sees the machine's torch and the vLLM kit through .pth files; bin/spswap), and the
#     CRIU bundle as /usr/local/sbin/criu;
#   - makes the normal user $SPSWAP_USER (default spuser) whose jobs find both;
#   - sets kernel.io_uring_disabled=2 (CRIU cannot dump io_uring);
#   - starts Slurm through scripts/slurm_up.sh: GRES gpu from the real /dev/nvidia* (+4
#     shards each), proctrack/cgroup + task/cgroup + ConstrainDevices on cgroup v2, the
#     project's prolog and epilog, partitions low (preemptable, REQUEUE, GraceTime) and
#     high, preempt_send_user_signal.
# Environment: SPSWAP_USER, GRACE_TIME (default 30), SPSWAP_PREFIX (default /opt/spswap),
# KEEP_BYTES (spswapd's SPSWAP_KEEP_BYTES; 0: every restore from its image),
# RESTORE_HUGEPAGES (SPSWAP_RESTORE_HUGEPAGES; 1: CRIU's restore fills in huge pages),
# KEEP_ON_GPU (SPSWAP_KEEP_ON_GPU; 1: kept instances wait with their GPU state on the GPU),
# ROOT_HUGE (1, the default: /dev/shm/spswap its own tmpfs mounted huge=within_size, as
# docs/slurm.md recommends; always: huge=always; 0: back on /dev/shm, 4 KiB pages).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PREFIX=${SPSWAP_PREFIX:-/opt/spswap}
USER_NAME=${SPSWAP_USER:-spuser}
say() { echo "[gpu/slurm_up] $*"; }
die() { echo "gpu/slurm_up: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root"

if [ "${1:-up}" = down ]; then
    [ -x "$PREFIX/src/scripts/slurm_up.sh" ] && bash "$PREFIX/src/scripts/slurm_up.sh" down
    pkill -x munged 2>/dev/null || true
    # spswap's root mounted by `up` (ROOT_HUGE): spswapd first, then the mount goes
    if mountpoint -q /dev/shm/spswap; then
        "$PREFIX/bin/spswap" daemon stop >/dev/null 2>&1 || true
        umount /dev/shm/spswap || die "could not unmount /dev/shm/spswap (busy?)"
        rmdir /dev/shm/spswap 2>/dev/null || true
    fi
    exit 0
fi
[ "${1:-up}" = up ] || die "unknown command '$1': use 'up' or 'down'"

# -- Slurm and munge from the carried packages -------------------------------------------
if ! command -v slurmd >/dev/null; then
    ls "$REPO"/.device/slurmdebs/*.deb >/dev/null 2>&1 \
        || die "no .device/slurmdebs: run 'bash scripts/gpu/kits.sh slurm' on a machine with apt"
    mkdir -p /opt/slurmkit
    for deb in "$REPO"/.device/slurmdebs/*.deb; do dpkg -x "$deb" /opt/slurmkit; done
    cp -an /opt/slurmkit/usr/. /usr/
    cp -an /opt/slurmkit/etc/. /etc/ 2>/dev/null || true
    # Debian 12 keeps libdbus (cgroup_v2.so needs it) in /lib/x86_64-linux-gnu.
    cp -an /opt/slurmkit/lib/x86_64-linux-gnu/. /usr/lib/x86_64-linux-gnu/ 2>/dev/null || true
    ldconfig
    # Debian names the daemons *-wlm; slurmd runs slurmstepd by its compiled path.
    for b in slurmd slurmctld slurmstepd; do ln -sf "/usr/sbin/$b-wlm" "/usr/sbin/$b"; done
fi
missing=$(ldd /usr/sbin/slurmd /usr/sbin/slurmctld /usr/sbin/munged /usr/lib/x86_64-linux-gnu/slurm-wlm/*.so 2>/dev/null | grep "not found" | sort -u || true)
[ -z "$missing" ] || say "libraries not found: $missing"
# The packages' maintainer scripts did not run: make munge's user and directories.
id munge >/dev/null 2>&1 || useradd -r -M -d /var/lib/munge -s /usr/sbin/nologin munge
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
mkdir -p /etc/slurm

# -- spswap for root's prolog and for the users' jobs ------------------------------------
TORCH_PY=$(command -v python3)
for cand in /opt/torch/.venv/bin/python3 "$TORCH_PY"; do
    [ -x "$cand" ] && "$cand" -c 'import torch' 2>/dev/null && { TORCH_PY=$cand; break; }
done
TORCH_SITE=$("$TORCH_PY" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
BASE_PY=$("$TORCH_PY" -c 'import sys; print(sys._base_executable)')
BASE_PY=$(readlink -f "$BASE_PY")
# Users must be able to run the interpreter (a pyenv under /root is not).
su -s /bin/sh nobody -c "'$BASE_PY' -c 0" 2>/dev/null || die "$BASE_PY cannot be run by other users"
rm -rf "$PREFIX/src"; mkdir -p "$PREFIX"
tar -C "$REPO" --exclude=./.device --exclude=./.git --exclude=./.venv --exclude=./.criu-build -cf - . \
    | (mkdir -p "$PREFIX/src" && tar -C "$PREFIX/src" -xf -)
# as scripts/install.sh does: spuser cannot write __pycache__ here (every run's start
# would compile spswap's modules again: its start to its reservation 0.30 -> 0.21 s)
find "$PREFIX/src" -name __pycache__ -prune -exec rm -rf {} +
"$TORCH_PY" -m compileall -q "$PREFIX/src/spswap" >/dev/null || say "could not compile spswap's bytecode"
[ -x "$PREFIX/venv/bin/python" ] || "$BASE_PY" -m venv --without-pip "$PREFIX/venv"
SITE=$("$PREFIX/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d "$REPO/.device/vllmkit" ] && [ ! -e "$PREFIX/kit/.site.done" ]; then
    bash "$REPO/.device/vllmkit/install_kit.sh" "$PREFIX/kit" >/dev/null
fi
if ls "$REPO"/.device/serveaddon/*.whl >/dev/null 2>&1 && [ ! -d "$PREFIX/kit/addon" ]; then
    "$BASE_PY" -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(sys.argv[2] + '/*.whl')]" \
        "$PREFIX/kit/addon" "$REPO/.device/serveaddon"
fi
{
    echo "$PREFIX/src"
    echo "$TORCH_SITE"
    [ -d "$PREFIX/kit/site" ] && echo "$PREFIX/kit/site"
    [ -d "$PREFIX/kit/addon" ] && echo "$PREFIX/kit/addon"
} > "$SITE/spswap-gpu.pth"
# The console script, as pip would write it, from pyproject's [project.scripts] entry.
ENTRY=$(sed -n 's/^spswap = "\(.*\)"/\1/p' "$PREFIX/src/pyproject.toml")
mkdir -p "$PREFIX/bin"
cat > "$PREFIX/venv/bin/spswap" <<EOF
#!$PREFIX/venv/bin/python
import sys
from ${ENTRY%%:*} import ${ENTRY##*:}
sys.exit(${ENTRY##*:}())
EOF
chmod 755 "$PREFIX/venv/bin/spswap"
ln -sf "$PREFIX/venv/bin/spswap" "$PREFIX/bin/spswap"
chmod -R a+rX "$PREFIX"
"$PREFIX/bin/spswap" --version

# the carried bundle, also over one an earlier `up` installed with other patches
bundle_stamp() { tar -xJOf "$REPO/.device/criu-bundle.tar.xz" bundle/share/spswap/criu-patches 2>/dev/null; }
if [ -f "$REPO/.device/criu-bundle.tar.xz" ] && { [ ! -x /usr/local/sbin/criu ] || {
   [ "$(readlink /usr/local/sbin/criu)" = "$PREFIX/criu/bundle/criu" ] &&
   [ "$(cat "$PREFIX/criu/bundle/share/spswap/criu-patches" 2>/dev/null)" != "$(bundle_stamp)" ]; }; }; then
    rm -rf "$PREFIX/criu/bundle"
    mkdir -p "$PREFIX/criu" && tar -C "$PREFIX/criu" -xJf "$REPO/.device/criu-bundle.tar.xz"
    ln -sf "$PREFIX/criu/bundle/criu" /usr/local/sbin/criu
fi
command -v criu >/dev/null && criu --version | head -1
sysctl -qw kernel.io_uring_disabled=2 || say "could not set kernel.io_uring_disabled=2"

id "$USER_NAME" >/dev/null 2>&1 || useradd -m -s /bin/bash "$USER_NAME"
# The user's login environment: spswap on PATH (vLLM and torch come through the venv).
PROFILE_LINE="export PATH=$PREFIX/venv/bin:\$PATH VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1"
grep -qxF "$PROFILE_LINE" "/home/$USER_NAME/.profile" 2>/dev/null || echo "$PROFILE_LINE" >> "/home/$USER_NAME/.profile"

# -- Slurm, as docs/slurm.md recommends --------------------------------------------------
SPSWAP_BIN="$PREFIX/bin/spswap" SLURM_PROLOG="$PREFIX/src/slurm/prolog.sh" \
    SLURM_EPILOG="$PREFIX/src/slurm/epilog.sh" PROCTRACK=cgroup TASK_PLUGIN=task/cgroup \
    CONSTRAIN_DEVICES=yes REAL_GPUS=1 GRACE_TIME="${GRACE_TIME:-30}" \
    bash "$PREFIX/src/scripts/slurm_up.sh" up
# Where the prolog-started spswapd finds CRIU (it runs with almost no PATH).
command -v criu >/dev/null && echo "SPSWAP_CRIU=$(command -v criu)" >> /etc/default/spswap
# KEEP_BYTES=0: no instance kept alive, every restore from its image (user_flow.sh's image
# path); the prolog starts spswapd after this, so the setting holds from the first job.
[ -n "${KEEP_BYTES:-}" ] && echo "SPSWAP_KEEP_BYTES=$KEEP_BYTES" >> /etc/default/spswap
# RESTORE_HUGEPAGES=1: CRIU's restore fills in huge pages (the bundle has the patch)
[ -n "${RESTORE_HUGEPAGES:-}" ] && echo "SPSWAP_RESTORE_HUGEPAGES=$RESTORE_HUGEPAGES" >> /etc/default/spswap
# KEEP_ON_GPU=1: a kept instance's GPU state waits on its GPU (the next run only unlocks it)
[ -n "${KEEP_ON_GPU:-}" ] && echo "SPSWAP_KEEP_ON_GPU=$KEEP_ON_GPU" >> /etc/default/spswap
# these lines are the script's own, not an admin's edit: the next `up` (root_huge_compare.sh
# runs two) writes the file again instead of refusing it as edited
cp /etc/default/spswap "${SLURM_CI_DIR:-/tmp/spswap-slurm}/spswap-defaults.written"
# a spswapd of an earlier `up` keeps the settings it read: the next prolog starts it anew
"$PREFIX/bin/spswap" daemon stop >/dev/null 2>&1 || true
# ROOT_HUGE=1: spswap's root (pool, images) on its own tmpfs mounted huge=within_size (the
# pool's entries in 2 MiB pages: a registered entry is pinned per page); always: huge=always
# (the images too); 0: back on /dev/shm. A mount with another huge= is made anew (its pool
# and images go: the next flow starts cold).
ROOT_DIR=/dev/shm/spswap
ROOT_HUGE=${ROOT_HUGE:-1}
case "$ROOT_HUGE" in
    1) want_huge=within_size ;;
    always) want_huge=always ;;
    0) want_huge= ;;
    *) die "ROOT_HUGE=$ROOT_HUGE: use 1 (huge=within_size), always or 0" ;;
esac
have_huge=$({ findmnt -no OPTIONS "$ROOT_DIR" 2>/dev/null || true; } | tail -1 | tr , '\n' | sed -n 's/^huge=//p')
if mountpoint -q "$ROOT_DIR" && { [ -z "$want_huge" ] || [ "$have_huge" != "$want_huge" ]; }; then
    umount "$ROOT_DIR" || die "could not unmount $ROOT_DIR (busy?)"
    rm -rf "$ROOT_DIR"
fi
if [ -n "$want_huge" ] && ! mountpoint -q "$ROOT_DIR"; then
    rm -rf "$ROOT_DIR" && mkdir -m 0755 "$ROOT_DIR"
    mount -t tmpfs -o "huge=$want_huge,mode=0755,nosuid,nodev,size=100G" spswap-root "$ROOT_DIR"
fi
mountpoint -q "$ROOT_DIR" && say "spswap's root: $(findmnt -no OPTIONS "$ROOT_DIR")"
say "up: user $USER_NAME, spswap $PREFIX/bin/spswap, $(cat /etc/slurm/gres.conf | wc -l) gres lines"

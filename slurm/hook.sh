#!/bin/bash
# The body of spswap's Slurm Prolog and Epilog: `hook.sh prolog|epilog` runs
# `spswap node prolog|epilog` and ALWAYS exits 0 (a failing prolog or epilog drains the
# node; spswap's own trouble must never take a node out of service). See prolog.sh.
#
# slurmd runs this as root with almost no environment (no PATH). Settings come from
# $SPSWAP_DEFAULTS (default /etc/default/spswap), a file of VAR=value lines:
#   SPSWAP_BIN=/opt/spswap/venv/bin/spswap    the spswap executable
#   SPSWAP_ROOT=/dev/shm/spswap          log goes to $SPSWAP_ROOT/log/<prolog|epilog>.log
#   SPSWAP_HOOK_TIMEOUT_S=60             longest time spswap may take here
# slurmd reads this script's stdout/stderr until EOF, so everything goes to the log.
case "${1:-}" in prolog|epilog) ACTION=$1 ;; *) exit 0 ;; esac
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
DEFAULTS=${SPSWAP_DEFAULTS:-/etc/default/spswap}
# shellcheck disable=SC1090
[ -r "$DEFAULTS" ] && { set -a; . "$DEFAULTS" || true; set +a; }
ROOT=${SPSWAP_ROOT:-/dev/shm/spswap}
# The log goes under the root only where nobody else could have prepared it: on /dev/shm
# any user can make the root (and a symlink for the log) before spswapd does, and this
# runs as root. Else /var/log.
own_dir() {  # a directory of this user's, not a symlink, that no one else may write
    [ -d "$1" ] && [ ! -L "$1" ] || return 1
    local uid mode
    read -r uid mode < <(stat -c '%u %a' -- "$1" 2>/dev/null) || return 1
    [ "$uid" = "$(id -u)" ] && [ $(( 8#$mode & 8#022 )) -eq 0 ]
}
BIN=${SPSWAP_BIN:-}
if [ -z "$BIN" ]; then
    for candidate in /usr/local/bin/spswap /usr/bin/spswap /opt/spswap/venv/bin/spswap; do
        [ -x "$candidate" ] && { BIN=$candidate; break; }
    done
fi
FOUND=0; [ -n "$BIN" ] && [ -x "$BIN" ] && FOUND=1
LOG=/var/log/spswap-$ACTION.log
# Without spswap (a node it was removed from) nothing is made under the root: its log
# is used only where the root is still there.
if { [ "$FOUND" = 1 ] && [ ! -e "$ROOT" ] && [ ! -L "$ROOT" ]; } || own_dir "$ROOT"; then
    mkdir -p "$ROOT/log" 2>/dev/null
    own_dir "$ROOT" && own_dir "$ROOT/log" && { : >> "$ROOT/log/$ACTION.log"; } 2>/dev/null \
        && LOG=$ROOT/log/$ACTION.log
fi
exec </dev/null >>"$LOG" 2>&1 || exec >/dev/null 2>&1

say() { echo "$(date '+%F %T') job=${SLURM_JOB_ID:-?} $ACTION: $*"; }
if [ "$FOUND" != 1 ]; then
    say "spswap executable not found (SPSWAP_BIN='${SPSWAP_BIN:-}'): skipped, the job runs" \
        "without spswap. Set SPSWAP_BIN in $DEFAULTS; where spswap was taken off this node" \
        "on purpose this line is expected (off every node: take Prolog= and Epilog= out of" \
        "slurm.conf; docs/slurm.md, Removing spswap)"
    exit 0
fi
timeout -k 5 "${SPSWAP_HOOK_TIMEOUT_S:-60}" "$BIN" node "$ACTION"
rc=$?
if [ "$rc" = 0 ]; then
    say "ok"
elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    say "FAILED: '$BIN node $ACTION' took more than ${SPSWAP_HOOK_TIMEOUT_S:-60}s (killed); node left in service"
else
    say "FAILED: '$BIN node $ACTION' exited $rc; node left in service"
fi
exit 0

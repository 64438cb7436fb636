#!/bin/bash
# spswap's Slurm Prolog (slurm.conf: Prolog=/path/to/prolog.sh, PrologFlags=Alloc).
#
# Runs `spswap node prolog` (ensure the node daemon runs; record the job's GPUs and user) through hook.sh beside this file, and ALWAYS
# exits 0: a failing prolog drains the node, and spswap's own trouble must never take a
# node out of service. Failures are logged to $SPSWAP_ROOT/log/prolog.log. Settings:
# /etc/default/spswap (SPSWAP_BIN, SPSWAP_ROOT, SPSWAP_HOOK_TIMEOUT_S); see hook.sh.
HOOK="$(dirname "$0")/hook.sh"
[ -r "$HOOK" ] && /bin/bash "$HOOK" prolog
exit 0

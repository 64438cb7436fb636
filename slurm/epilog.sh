#!/bin/bash
# spswap's Slurm Epilog (slurm.conf: Epilog=/path/to/epilog.sh).
#
# Runs `spswap node epilog` (release what the job held: its slot reservations and pool uses; keep what must outlive it: images, pool entries) through hook.sh beside this file, and ALWAYS
# exits 0: a failing epilog drains the node, and spswap's own trouble must never take a
# node out of service. Failures are logged to $SPSWAP_ROOT/log/epilog.log. Settings:
# /etc/default/spswap (SPSWAP_BIN, SPSWAP_ROOT, SPSWAP_HOOK_TIMEOUT_S); see hook.sh.
HOOK="$(dirname "$0")/hook.sh"
[ -r "$HOOK" ] && /bin/bash "$HOOK" epilog
exit 0

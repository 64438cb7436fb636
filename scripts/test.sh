#!/usr/bin/env bash
# Run spswap's whole test suite on a fresh Debian 12 machine. As root it also builds CRIU
# from source (scripts/build_criu.sh), and the Slurm suites start a real single-node Slurm
# with scripts/slurm_up.sh (and stop it when they are done).
#
#   bash scripts/test.sh           # everything, slow suites included (what CI runs)
#   bash scripts/test.sh --fast    # skip the suites marked slow (no Slurm, no CRIU build)
#   bash scripts/test.sh -- ARGS   # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --fast) FAST=1 ;;
        --) shift; PYTEST_ARGS+=("$@"); break ;;
        *) PYTEST_ARGS+=("$1") ;;
    esac
    shift
done

bash scripts/install.sh --dev
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"

if [ "$FAST" = 0 ] && [ "$(id -u)" = 0 ]; then
    # Real CRIU (>= 4.1) and a real Slurm for the slow suites; each script is idempotent.
    if [ -f scripts/build_criu.sh ]; then bash scripts/build_criu.sh; fi
    if [ -f scripts/slurm_up.sh ]; then
        export SPSWAP_TEST_SLURM=1
    fi
fi

"$PY" -m ruff check spswap tests scripts
"$PY" -m ruff format --check spswap tests scripts   # `ruff format spswap tests scripts` fixes it
"$PY" -m mypy spswap
MARK=()
[ "$FAST" = 1 ] && MARK=(-m "not slow")
"$PY" -m pytest "${MARK[@]}" "${PYTEST_ARGS[@]}"

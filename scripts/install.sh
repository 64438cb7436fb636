#!/usr/bin/env bash
# Install spswap into a virtual environment (default ./.venv) on a Debian/Ubuntu machine.
#
#   bash scripts/install.sh            # spswap + torch (the demo and the reference engine)
#   bash scripts/install.sh --dev      # + test tools (pytest, hypothesis, ruff, mypy)
#   bash scripts/install.sh --no-torch # CLI, daemon, slots and pool only (login/admin nodes)
#
# Knobs: SPSWAP_VENV (./.venv), SPSWAP_TORCH ("torch==2.13.0": any pip requirement; a site
# with its own torch build sets it, or installs torch in the venv first).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPSWAP_VENV:-.venv}
TORCH_REQ=${SPSWAP_TORCH:-torch==2.13.0}
EXTRAS=torch
WITH_TORCH=1
for arg in "$@"; do
    case "$arg" in
        --dev) EXTRAS="torch,test" ;;
        --no-torch) WITH_TORCH=0 ;;
        *) echo "install.sh: unknown option $arg (use --dev or --no-torch)" >&2; exit 2 ;;
    esac
done
[ "$WITH_TORCH" = 1 ] || EXTRAS=${EXTRAS/torch/}; EXTRAS=${EXTRAS#,}

if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "install.sh: installing python3-venv"
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-venv python3-pip >/dev/null
    else
        echo "install.sh: python3 has no venv module; run: sudo apt-get install python3-venv" >&2
        exit 1
    fi
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ "$WITH_TORCH" = 1 ] && ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    echo "install.sh: installing $TORCH_REQ (set SPSWAP_TORCH to choose another build)"
    "${PIP[@]}" "$TORCH_REQ"
fi
"${PIP[@]}" -e ".${EXTRAS:+[$EXTRAS]}"
echo "install.sh: spswap installed in $VENV ($("$VENV/bin/spswap" --version))"

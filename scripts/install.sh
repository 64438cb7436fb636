#!/usr/bin/env bash
# Install spswap into a virtual environment (default ./.venv) on a Debian/Ubuntu machine.
#
#   bash scripts/install.sh            # spswap + torch (the demo and the reference engine)
#   bash scripts/install.sh --dev      # + test tools (pytest, hypothesis, ruff, mypy)
#   bash scripts/install.sh --no-torch # CLI, daemon, slots and pool only: an admin host that
#                                      # serves, makes and checks no model (login nodes where
#                                      # users run `spswap models make` need torch)
#   bash scripts/install.sh --check-python  # only say which Python the venv would be built on
#   bash scripts/install.sh --help     # this text
#
# Knobs: SPSWAP_VENV (./.venv), SPSWAP_TORCH ("torch==2.13.0": any pip requirement; a site
# with its own torch build sets it, or installs torch in the venv first), SPSWAP_PYTHON
# (the interpreter to build the venv on; as root the default is /usr/bin/python3, else
# the first python3 on PATH).
#
# As root (an install for the node's users, the hooks and spswapd) the interpreter must be
# one every user can run: a venv's python is a link to it, and one under a private
# directory (pyenv in /root, mode 0700) fails every user's spswap with "bad interpreter:
# Permission denied". install.sh refuses such an interpreter and names the fix.
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
        --check-python) CHECK_ONLY=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown option $arg (use --dev, --no-torch, --check-python or --help)" >&2
           exit 2 ;;
    esac
done
[ "$WITH_TORCH" = 1 ] || EXTRAS=${EXTRAS/torch/}; EXTRAS=${EXTRAS#,}

# The first directory on the way to $1 (or $1 itself) that other users cannot pass.
private_step() {
    local p=$1 mode
    case "$p" in /*) ;; *) p=$PWD/$p ;; esac  # dirname of a relative path ends at ".", not /
    while :; do
        mode=$(stat -L -c '%a' -- "$p" 2>/dev/null) || { echo "$p"; return 0; }
        (( 8#$mode & 8#001 )) || { echo "$p (mode $mode)"; return 0; }
        [ "$p" = / ] && return 1
        p=$(dirname -- "$p")
    done
}
# Why the interpreter $1 cannot be run by every user (nothing when it can): each link on
# the way to it, the path a venv would link to, the file that resolves to, its library.
not_for_everyone() {
    local py=$1 paths hop=$1 target step
    while :; do  # the links from $1 to the interpreter, one by one (a venv's python is one)
        if step=$(private_step "$hop"); then echo "$step"; return 0; fi
        [ -L "$hop" ] || break
        target=$(readlink -- "$hop")
        case "$target" in /*) hop=$target ;; *) hop=$(dirname -- "$hop")/$target ;; esac
    done
    paths=$("$py" -c 'import os, sys
exe = getattr(sys, "_base_executable", "") or sys.executable
print(os.path.abspath(exe)); print(os.path.realpath(exe)); print(sys.base_prefix)' 2>/dev/null) \
        || { echo "$py does not run"; return 0; }
    local p
    while IFS= read -r p; do
        if step=$(private_step "$p"); then echo "$step"; return 0; fi
    done <<< "$paths"
    return 1
}

# True when other users can reach the venv (where it is, or will be, made): an install for
# the node's users. A venv under root's own home is root's alone (the README's first try).
venv_shared() {
    local p
    p=$(realpath -m -- "$VENV")
    while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done
    ! private_step "$p" >/dev/null
}

PY=${SPSWAP_PYTHON:-}
if [ -z "$PY" ]; then
    if [ "$(id -u)" = 0 ] && [ -x /usr/bin/python3 ]; then
        PY=/usr/bin/python3  # the system's: every user can run it (not root's pyenv)
    else
        PY=$(command -v python3 || true)
    fi
fi
[ -n "$PY" ] && command -v "$PY" >/dev/null || {
    echo "install.sh: no python3 found (SPSWAP_PYTHON='${SPSWAP_PYTHON:-}'); run: sudo apt-get install python3" >&2
    exit 1
}
if [ "$(id -u)" = 0 ] && [ ! -x "$VENV/bin/python" ] && venv_shared \
        && why=$(not_for_everyone "$PY"); then
    echo "install.sh: $PY cannot be run by other users ($why is not open to them): every" \
        "user's spswap would fail with 'bad interpreter: Permission denied'. Build on a" \
        "Python every user can run: SPSWAP_PYTHON=/usr/bin/python3 bash scripts/install.sh" \
        "(apt-get install python3-venv)" >&2
    exit 1
fi
if [ "$(id -u)" = 0 ] && [ -x "$VENV/bin/python" ] && venv_shared \
        && why=$(not_for_everyone "$VENV/bin/python"); then
    echo "install.sh: warning: $VENV was built on a Python other users cannot run ($why" \
        "is not open to them): their spswap fails with 'bad interpreter'. For an install" \
        "the node's users run: rm -rf $VENV, then run install.sh again" >&2
fi
if [ "${CHECK_ONLY:-0}" = 1 ]; then
    if [ -x "$VENV/bin/python" ]; then
        echo "install.sh: $VENV exists (built on $("$VENV/bin/python" -c 'import sys; print(sys._base_executable)'))"
    else
        echo "install.sh: the venv would be built on $PY"
    fi
    exit 0
fi

if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "install.sh: installing python3-venv"
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-venv python3-pip >/dev/null
    else
        echo "install.sh: python3 has no venv module; run: sudo apt-get install python3-venv" >&2
        exit 1
    fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ "$WITH_TORCH" = 1 ] && ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    echo "install.sh: installing $TORCH_REQ (set SPSWAP_TORCH to choose another build)"
    "${PIP[@]}" "$TORCH_REQ"
fi
"${PIP[@]}" -e ".${EXTRAS:+[$EXTRAS]}"
# An editable install compiles nothing, and users cannot write __pycache__ in a checkout
# root installed: without this every user's `spswap serve` compiles its ~100 modules
# again at its start, about 0.1 s of each requeued run (spswap doctor's "bytecode" row).
# -f and umask 022: bytecode an earlier compile left readable by root alone is rewritten.
(umask 022 && "$VENV/bin/python" -m compileall -q -f spswap >/dev/null) ||
    echo "install.sh: could not compile spswap's bytecode (spswap runs, its start is slower)" >&2
echo "install.sh: spswap installed in $VENV ($("$VENV/bin/spswap" --version))"

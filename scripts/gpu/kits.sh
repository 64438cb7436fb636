#!/usr/bin/env bash
# Build, on a Debian 12 machine with internet (the CPU machine), everything a GPU machine
# without internet needs to run spswap's GPU path under a real Slurm, into git-ignored
# folders under .device/ that travel with a device call:
#
#   .device/slurmdebs/        Debian 12's Slurm 22.05 + munge packages (~4 MB), for
#                             scripts/gpu/slurm_up.sh
#   .device/criu-bundle.tar.xz  CRIU >= 4.1 with its libraries (scripts/build_criu.sh --bundle)
#   .device/vllmkit/          vLLM 0.26 stripped for H100/H200 (scripts/gpu/vllm_kit/make.sh)
#   .device/serveaddon/       the wheels vLLM's OpenAI server needs beyond the kit
#
#   bash scripts/gpu/kits.sh [slurm] [criu] [vllm]    # default: all three
#
# Each part is skipped when its output is already there (delete it to rebuild). Run as root
# (apt-get, and the CRIU build installs its build dependencies).
set -euo pipefail
cd "$(dirname "$0")/../.."
PARTS="${*:-slurm criu vllm}"
want() { [[ " $PARTS " == *" $1 "* ]]; }
say() { echo "kits: $*"; }
mkdir -p .device
grep -qx '/.device/' .gitignore 2>/dev/null || grep -qx '.device/' .gitignore \
    || { echo "kits: .device/ is not git-ignored: add it to .gitignore first" >&2; exit 1; }

# The packages slurmctld, slurmd, the clients and munge need on Ubuntu 24.04 that it lacks
# (libdbus for cgroup_v2.so). scripts/gpu/slurm_up.sh unpacks them into a prefix, never '/'.
SLURM_DEBS=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge libmunge2 libhwloc15
            libjson-c5 liblua5.1-0 libyaml-0-2 libnuma1 libdbus-1-3)
if want slurm; then
    if ls .device/slurmdebs/slurmd_*.deb >/dev/null 2>&1; then
        say "slurm: .device/slurmdebs already there"
    else
        mkdir -p .device/slurmdebs
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        # apt's sandbox user cannot write into root's work tree: download in a scratch dir.
        tmp=$(mktemp -d); chmod 755 "$tmp"
        (cd "$tmp" && apt-get download -qq "${SLURM_DEBS[@]}")
        mv "$tmp"/*.deb .device/slurmdebs/ && rmdir "$tmp"
        say "slurm: $(ls .device/slurmdebs | wc -l) packages, $(du -sh .device/slurmdebs | cut -f1)"
    fi
fi

if want criu; then
    # a bundle built with other patches than scripts/criu-patches/ holds now is rebuilt
    patches=$(bash scripts/build_criu.sh --stamp)
    stamp() { tar -xJOf "$1" bundle/share/spswap/criu-patches 2>/dev/null; }
    if [ -f .device/criu-bundle.tar.xz ] && [ "$(stamp .device/criu-bundle.tar.xz)" = "$patches" ]; then
        say "criu: .device/criu-bundle.tar.xz already there"
    else
        [ "$(cat .criu-build/bundle/share/spswap/criu-patches 2>/dev/null)" = "$patches" ] \
            || { rm -rf .criu-build/bundle; bash scripts/build_criu.sh --force --prefix \
                 .criu-build/prefix --bundle .criu-build/bundle; }
        tar -C .criu-build -cJf .device/criu-bundle.tar.xz bundle
        say "criu: $(du -sh .device/criu-bundle.tar.xz | cut -f1) (patches: $patches)"
    fi
fi

if want vllm; then
    if ls .device/vllmkit/site.tar.xz.part* >/dev/null 2>&1 && ls .device/serveaddon/*.whl >/dev/null 2>&1; then
        say "vllm: .device/vllmkit and .device/serveaddon already there"
    else
        KIT=.device/vllmkit bash scripts/gpu/vllm_kit/make.sh
    fi
fi
du -sh .device 2>/dev/null | sed 's/^/kits: total /'

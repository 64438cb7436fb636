#!/usr/bin/env bash
# GPU-machine side of the vLLM kit (built by scripts/gpu/vllm_kit/make.sh): unpack its
# site.tar.xz.part* into DEST/site, a ready site dir that needs no pip; then put it on
# PYTHONPATH.
#
# Why: the GPU machine has no internet and no pip index; the kit carries vLLM and the wheels
# it lacks as one xz stream that unpacks in a few seconds.
#
# Usage, from the project root on the GPU machine, with the kit copied along:
#
#   bash scripts/gpu/vllm_kit/install.sh [DEST]      # DEST default /tmp/kit
#   export PYTHONPATH=DEST/site:$PYTHONPATH
#
# The kit is read from the folder this script sits in when the parts are there (make.sh
# copies it into the kit as install_kit.sh), else from $KIT (default .device/vllmkit).
# Every part listed in the kit's SHA256SUMS must be present and match. Idempotent: when
# DEST/site already holds this very kit (same SHA256SUMS) it does nothing; a different or
# half-unpacked kit there is replaced.
set -euo pipefail
DEST="${1:-/tmp/kit}"
HERE="$(cd "$(dirname "$0")" && pwd)"
if ls "$HERE"/site.tar.xz.part* >/dev/null 2>&1; then
    KITDIR="$HERE"
else
    KITDIR="${KIT:-.device/vllmkit}"
fi
die() { echo "install: $*" >&2; exit 1; }
[ -d "$KITDIR" ] \
    || die "no kit folder $KITDIR (build it with scripts/gpu/vllm_kit/make.sh and carry it)"
KITDIR="$(cd "$KITDIR" && pwd)"
ls "$KITDIR"/site.tar.xz.part* >/dev/null 2>&1 || die "no site.tar.xz.part* in $KITDIR"
[ -f "$KITDIR/SHA256SUMS" ] || die "no SHA256SUMS in $KITDIR"

MARKER="$DEST/.site.done"   # holds the SHA256SUMS of the kit unpacked in DEST/site
if [ -f "$MARKER" ] && cmp -s "$MARKER" "$KITDIR/SHA256SUMS"; then
    echo "install: $DEST/site already holds this kit"
    exit 0
fi

t0=$(date +%s%N)
(cd "$KITDIR" && sha256sum -c --quiet SHA256SUMS) \
    || die "the parts in $KITDIR do not match SHA256SUMS (all parts must be carried, unchanged)"
rm -rf "$DEST/site" "$MARKER"
mkdir -p "$DEST/site"
# The parts in SHA256SUMS order (split names them 00, 01, ... so this is stream order).
parts=()
while read -r _sum name; do parts+=("$KITDIR/${name#\*}"); done < "$KITDIR/SHA256SUMS"
cat "${parts[@]}" | xz -d -T0 | tar -x -C "$DEST/site" || die "unpacking into $DEST/site failed"
cp "$KITDIR/SHA256SUMS" "$MARKER"
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
echo "install: $(du -sh "$DEST/site" | cut -f1) in $DEST/site," \
    "$((ms / 1000)).$(printf %03d $((ms % 1000))) s"

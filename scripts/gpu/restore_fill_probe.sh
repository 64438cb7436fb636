#!/usr/bin/env bash
# How fast CRIU's restore fills a large private region, in 4 KiB pages (stock) and in huge
# pages (CRIU_THP_FILL=1, what SPSWAP_RESTORE_HUGEPAGES=1 sets), with and without
# --auto-dedup (a run's restore, and the one at the job's prolog): the figures that say
# whether a node should turn the setting on (docs/benchmarks.md). A process holding MIB
# MiB of written anonymous memory is dumped to /dev/shm and restored (detached, timed),
# the four ways alternating, ROUNDS times; prints one JSON line per restore. Root; needs
# a CRIU built by scripts/build_criu.sh (with its thp-fill patch): $SPSWAP_CRIU, else
# .criu-build/bundle/criu, else criu on PATH. WORK_DIR (default /dev/shm): where the
# image goes, e.g. a tmpfs mounted huge=within_size against one mounted huge=always (the
# image file's own pages: 4 KiB under within_size, which CRIU's appends never reach).
#
#   bash scripts/gpu/restore_fill_probe.sh [MIB (2048)] [ROUNDS (3)]
set -uo pipefail
MIB=${1:-2048}
ROUNDS=${2:-3}
CRIU=${SPSWAP_CRIU:-}
[ -n "$CRIU" ] || { [ -x .criu-build/bundle/criu ] && CRIU=$PWD/.criu-build/bundle/criu; }
[ -n "$CRIU" ] || CRIU=$(command -v criu) || { echo "restore_fill_probe: no criu" >&2; exit 2; }
real=$(readlink -f "$CRIU")
grep -qs thp-fill.patch "$(dirname "$real")/share/spswap/criu-patches" \
    "$(dirname "$(dirname "$real")")/share/spswap/criu-patches" \
  || { echo "restore_fill_probe: $CRIU was not built with scripts/criu-patches/thp-fill.patch: rebuild it (scripts/build_criu.sh, or scripts/gpu/kits.sh criu for the bundle)" >&2; exit 2; }
W=$(mktemp -d "${WORK_DIR:-/dev/shm}/restore-fill.XXXXXX")
trap 'rm -rf "$W"' EXIT
echo "{\"thp\": \"$(cat /sys/kernel/mm/transparent_hugepage/enabled)\", \"criu\": \"$CRIU\", \"work_mount\": \"$(findmnt -no OPTIONS --target "$W")\"}"
for r in $(seq 1 "$ROUNDS"); do
  # dedup 1: --auto-dedup, as a run's restore from an image (its pages freed as they are
  # read); 0: without, as the restore at the job's prolog (the image stays, the way back)
  for dedup in 0 1; do
  for fill in 0 1; do
    rm -rf "$W/img" "$W/pid"; mkdir -p "$W/img"
    setsid python3 -c '
import mmap, os, sys, time
size = int(sys.argv[1]) << 20
m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
block = os.urandom(1 << 20)
for off in range(0, size, 1 << 20):
    m[off:off + (1 << 20)] = block
open(sys.argv[2], "w").write(str(os.getpid()))
while True:
    time.sleep(1)
' "$MIB" "$W/pid" </dev/null >/dev/null 2>&1 &
    disown  # (this shell still reaps it, which frees its pid for the restore; no 'Killed')
    while [ ! -s "$W/pid" ]; do sleep 0.05; done
    pid=$(cat "$W/pid")
    "$CRIU" dump -t "$pid" -D "$W/img" -o dump.log >/dev/null 2>&1 \
      || { echo "restore_fill_probe: dump failed: $(tail -3 "$W/img/dump.log")" >&2; exit 1; }
    t0=$(date +%s%N)
    dd=(); [ "$dedup" = 1 ] && dd=(--auto-dedup)
    CRIU_THP_FILL=$fill "$CRIU" restore -D "$W/img" -d "${dd[@]}" -o restore.log >/dev/null 2>&1 \
      || { echo "restore_fill_probe: restore failed: $(tail -3 "$W/img/restore.log")" >&2; exit 1; }
    t1=$(date +%s%N)
    huge=$(awk '/AnonHugePages/ {print $2}' "/proc/$pid/smaps_rollup"); huge=${huge:-0}
    ms=$(( (t1 - t0) / 1000000 ))
    echo "{\"round\": $r, \"auto_dedup\": $dedup, \"huge_pages\": $fill, \"mib\": $MIB, \"restore_ms\": $ms, \"anon_huge_kib\": $huge, \"gb_per_s\": $(python3 -c "print(round($MIB * 1048576 / ($ms / 1000) / 1e9, 2))")}"
    kill -9 "$pid" 2>/dev/null; while kill -0 "$pid" 2>/dev/null; do sleep 0.02; done
  done
  done
done

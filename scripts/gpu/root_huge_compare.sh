#!/usr/bin/env bash
# The same-run comparison docs/slurm.md's huge-page "Modes" bullet asks for: the user's
# flow (scripts/gpu/user_flow.sh, every restore from its image) with spswap's root mounted
# each way in turn on one machine, alternating, ROUNDS times. Run as root from the project
# root on the GPU machine, with the kits in .device/ (scripts/gpu/kits.sh); it brings Slurm
# up itself (scripts/gpu/slurm_up.sh, once per mount: the root is remounted) and leaves it
# up with the last mode.
#
#   MODEL=/opt/spswap-models/qwen2-3b OUT=/tmp/cmp bash scripts/gpu/root_huge_compare.sh
#
# Environment: MODEL (default the 3B; made when missing, as user_flow.sh does), MODES
# (ROOT_HUGE values, default "1 always": huge=within_size then huge=always), ROUNDS
# (default 1), TIMEOUT_S (per wait in user_flow.sh, default 170), RESTORE_HUGEPAGES (1).
# Prints one "CMP {...}" line per flow: the mode, the restore's steps (CRIU restore and
# CUDA restore at the prolog, from spswapd's events), the high job's end -> serving and
# -> first answer; each flow's files under $OUT/<mode>-<round>/.
set -uo pipefail
MODEL=${MODEL:-/opt/spswap-models/qwen2-3b}
MODES=${MODES:-1 always}
ROUNDS=${ROUNDS:-1}
OUT=${OUT:-/tmp/spswap-root-huge}
export TIMEOUT_S=${TIMEOUT_S:-170}
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    dir="$OUT/$mode-$round"
    ROOT_HUGE=$mode RESTORE_HUGEPAGES=${RESTORE_HUGEPAGES:-1} KEEP_BYTES=0 \
      bash scripts/gpu/slurm_up.sh up > "$OUT/up-$mode-$round.log" 2>&1 \
      || { echo "root_huge_compare: slurm_up.sh up failed (ROOT_HUGE=$mode): $OUT/up-$mode-$round.log"; exit 1; }
    MODEL=$MODEL OUT=$dir bash scripts/gpu/user_flow.sh > "$dir.log" 2>&1
    rc=$?
    python3 - "$mode" "$round" "$rc" "$dir/flow.jsonl" <<'EOF'
import json, sys
mode, round_, rc, path = sys.argv[1:]
steps = {}
try:
    for line in open(path):
        s = json.loads(line)
        steps[s["step"]] = s
except OSError:
    pass
restored = steps.get("restored", {})
found = {}
for _, _, kind, timings in steps.get("timeline", {}).get("steps", {}).get("timeline", []):
    if kind in ("restore.restored_early", "restore.woken_early"):
        found.update(timings)
print("CMP " + json.dumps({
    "root_huge": mode, "round": int(round_), "rc": int(rc), "path": restored.get("path"),
    "criu_restore_s": found.get("criu_restore"), "cuda_restore_s": found.get("cuda_restore"),
    "high_end_to_serving_s": restored.get("high_end_to_serving_s"),
    "high_end_to_first_answer_s": restored.get("high_end_to_first_answer_s"),
    "identical": restored.get("identical"),
    "image_bytes": steps.get("image", {}).get("image", {}).get("size_bytes")}))
EOF
  done
done

#!/usr/bin/env bash
# `spswap bench traffic --engine vllm` on the GPU machine (issue 17): Poisson traffic
# against one multi-model job's router, 32-token greedy answers, every answer compared
# with the model's cold answer. Runs as root from the project root, with the vLLM kit in
# .device/vllmkit (unpacked to /tmp/kit here, as scripts/gpu/run_vllm.sh does). No
# spswapd: root writes the pool itself (a fresh one on /dev/shm), and the bench takes no
# slot. Models: Qwen2-shaped with peaked weights (scripts/gpu/make_models.py) in
# /tmp/spswap-models:
#   4 models: 0.5B, 1.5B, 3B, 1.5B seed 7                 at RATE_4 (64) requests/min
#   6 models: the same + 0.5B seed 7, 0.5B seed 9          at RATE_6 (48) requests/min
# each two-resident then one-resident on the same engines (AWAKE "2,1"). vLLM runs eager
# by default (EAGER=1): compiled starts (60-100 s each) do not fit the budget.
#
#   OUT=/tmp/traffic bash scripts/gpu/traffic.sh
#
# Environment: DURATION_S (60: seconds of traffic per rate and awake count), BUDGET_S
# (520: the whole script, model creation and cold starts included), RATE_4, RATE_6,
# AWAKE ("2,1"), KV_GIB (4: each model's KV cache), MAX_NEW (32), EAGER (1), COUNTS
# ("4,6"), VLLM_ARGS (vLLM's own options, one string), TEST (0; 1: then
# tests/multi/test_vllm_multi_gpu.py if time is left).
# Output: $OUT/traffic.json (rewritten after every rate: a cut run keeps its rows),
# $OUT/traffic.log (the bench's progress and the engines' stderr), $OUT/models.jsonl.
set -uo pipefail
OUT="${OUT:-/tmp/spswap-traffic-out}"
BUDGET_S="${BUDGET_S:-520}"
DURATION_S="${DURATION_S:-60}"
RATE_4="${RATE_4:-64}"
RATE_6="${RATE_6:-48}"
AWAKE="${AWAKE:-2,1}"
KV_GIB="${KV_GIB:-4}"
MAX_NEW="${MAX_NEW:-32}"
EAGER="${EAGER:-1}"
COUNTS="${COUNTS:-4,6}"
MODELS=/tmp/spswap-models
export SPSWAP_ROOT=/dev/shm/spswap-traffic
# The pool belongs on tmpfs; a container's /dev/shm may be too small for it (~17 GB here).
if [ "$(df -B1G --output=avail /dev/shm | tail -1)" -lt 30 ]; then SPSWAP_ROOT=/tmp/spswap-traffic; fi
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
step() { echo "=== $1 (t=$(( $(date +%s) - start ))s, $(left) s left)"; }

export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
step kit
if [ ! -d /tmp/kit/site/vllm ]; then
  timeout -k 5 120 bash .device/vllmkit/install_kit.sh /tmp/kit || { echo "traffic: kit failed"; exit 2; }
fi
export PYTHONPATH="/tmp/kit/site:$PWD"
nvidia-smi --query-gpu=name,driver_version,persistence_mode,memory.used,memory.total --format=csv
timeout -k 5 60 python3 -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__)" \
  || { echo "traffic: vLLM does not import"; exit 2; }
echo "pool: $SPSWAP_ROOT (fresh); out: $OUT; duration ${DURATION_S}s per rate; awake $AWAKE; eager $EAGER"
rm -rf "$SPSWAP_ROOT"

step models
# SIZE@SEED -> directory name (make_models.py's)
name_of() { local size=${1%@*} seed=0; [ "$1" != "$size" ] && seed=${1#*@}
  echo "qwen2-$size$([ "$seed" != 0 ] && echo "-s$seed")"; }
ALL="0.5b 1.5b 3b 1.5b@7 0.5b@7 0.5b@9"
dirs=()
for item in $ALL; do
  size=${item%@*}; seed=0; [ "$item" != "$size" ] && seed=${item#*@}
  d="$MODELS/$(name_of "$item")"
  if [ ! -f "$d/config.json" ]; then
    timeout -k 5 $(( $(left) - 60 )) python3 scripts/gpu/make_models.py --out "$MODELS" \
      --sizes "$size" --seed "$seed" | tee -a "$OUT/models.jsonl" \
      || { echo "traffic: make_models failed for $item"; exit 3; }
  fi
  dirs+=("$d")
done
echo "models: ${dirs[*]}"

step bench
eager=--eager; [ "$EAGER" = 1 ] || eager=--no-eager
extra=(); [ -n "${VLLM_ARGS:-}" ] && extra=(--vllm-args "$VLLM_ARGS")
model_args=(); for d in "${dirs[@]}"; do model_args+=(--models "$d"); done
limit=$(( $(left) - 15 - (${TEST:-0} == 1 ? 120 : 0) ))
echo "bench: up to ${limit}s; counts $COUNTS, rates 4:$RATE_4 6:$RATE_6"
timeout -k 20 "$limit" python3 -m spswap.cli bench traffic --engine vllm \
  --model-counts "$COUNTS" --rates "4:$RATE_4,6:$RATE_6" --awake "$AWAKE" \
  --duration-s "$DURATION_S" --max-new-tokens "$MAX_NEW" --kv-cache-gib "$KV_GIB" \
  --p95-target-s 2 $eager "${extra[@]}" "${model_args[@]}" --out "$OUT/traffic.json" \
  2> >(tee "$OUT/traffic.log" | grep --line-buffered "bench traffic\|spswap serve\|Error\|error" >&2)
echo "bench rc=$? after $(( $(date +%s) - start )) s"
if [ -f "$OUT/traffic.json" ]; then
  python3 - "$OUT/traffic.json" <<'EOF'
import json, sys
from spswap.bench.traffic_plan import RateRow, render
r = json.load(open(sys.argv[1]))
print(render([RateRow(**row) for row in r["rows"]], r["p95_target_s"]), end="")
for s in r["starts"]:
    print(f"start: {s['models']} models: {s['model']} from {s.get('from')} in {s.get('load_s', 0):.1f} s")
EOF
else
  echo "traffic: no report (the bench did not finish a rate)"
fi

if [ "${TEST:-0}" = 1 ] && [ "$(left)" -gt 90 ]; then
  step test
  SPSWAP_TEST_VLLM_MODELS="$MODELS/qwen2-0.5b $MODELS/qwen2-0.5b-s7" \
    SPSWAP_TEST_ROOT="$SPSWAP_ROOT-test" timeout -k 10 $(( $(left) - 10 )) \
    python3 -m pytest tests/multi/test_vllm_multi_gpu.py -q -rs -s -p no:cacheprovider \
    --junitxml="$OUT/test-multi.xml"
  echo "test rc=$?"
  rm -rf "$SPSWAP_ROOT-test"
fi
nvidia-smi --query-compute-apps=pid,used_memory --format=csv  # nothing left behind
rm -rf "$SPSWAP_ROOT"
step done

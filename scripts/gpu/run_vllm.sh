#!/usr/bin/env bash
# On a GPU machine, from the project root, with a vLLM kit in .device/vllmkit (see
# scripts/gpu/README.md): unpack the kit, write Qwen2-style models with real safetensors,
# run the vLLM engine tests, then `python -m spswap.bench.swap`. Everything goes to
# $OUT (default /tmp/spswap-gpu-out). Each step has its own time limit; the 7B model is
# made and benched only while BUDGET_S seconds (default 520) leave room for it.
set -uo pipefail
OUT="${OUT:-/tmp/spswap-gpu-out}"
BUDGET_S="${BUDGET_S:-520}"
MODELS=/tmp/spswap-models
POOL=/dev/shm/spswap-bench/pool
mkdir -p "$OUT"
# The pool belongs on tmpfs; a container's /dev/shm may be too small for it.
if [ "$(df -B1G --output=avail /dev/shm | tail -1)" -lt 40 ]; then POOL=/tmp/spswap-bench/pool; fi
echo "pool: $POOL"
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
step() { echo "=== $1 (t=$(( $(date +%s) - start ))s)"; }

export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
step kit
bash .device/vllmkit/install_kit.sh /tmp/kit || exit 2
export PYTHONPATH="/tmp/kit/site:$PWD"
nvidia-smi --query-gpu=name,driver_version,persistence_mode,memory.total --format=csv
python3 -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__)"
df -h /tmp /dev/shm | tail -2

step models
timeout -k 5 120 python3 scripts/gpu/make_models.py --out "$MODELS" --sizes 0.5b 1.5b || exit 3

step tests
SPSWAP_TEST_VLLM_MODEL="$MODELS/qwen2-0.5b" SPSWAP_TEST_POOL="$POOL-tests" \
  timeout -k 5 170 python3 -m pytest tests/engines/test_vllm.py -q -rs -x -p no:cacheprovider \
  --junitxml="$OUT/tests.xml"
echo "tests rc=$?"
rm -rf "$POOL-tests"

step bench-small
timeout -k 5 $(( $(left) - 10 )) python3 -m spswap.bench.swap \
  --models "$MODELS/qwen2-0.5b" "$MODELS/qwen2-1.5b" --pool-dir "$POOL" --out "$OUT/bench.json"
echo "bench rc=$?"
rm -rf "$MODELS/qwen2-0.5b" "$MODELS/qwen2-1.5b"

if [ "$(left)" -gt 200 ]; then
  step 7b
  timeout -k 5 60 python3 scripts/gpu/make_models.py --out "$MODELS" --sizes 7b \
    && timeout -k 5 $(( $(left) - 5 )) python3 -m spswap.bench.swap \
         --models "$MODELS/qwen2-7b" --pool-dir "$POOL" --cycles 2 --out "$OUT/bench-7b.json"
  echo "7b rc=$?"
else
  echo "=== 7b skipped: $(left) s left"
fi
step done

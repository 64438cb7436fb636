#!/usr/bin/env bash
# On a GPU machine, from the project root, with a vLLM kit in .device/vllmkit (see
# scripts/gpu/README.md): unpack the kit, write Qwen2-style models with real safetensors,
# then run the steps named in STEPS (default: "skeleton bench tests"), in that order:
#   skeleton  scripts/gpu/vllm_skeleton.py (needs root, a CRIU >= 4.1 in SPSWAP_CRIU,
#             .criu-build/bundle or packed in .device/criu-bundle.tar.xz, and sets
#             kernel.io_uring_disabled=2 for its run)
#   skeletonc the same with vLLM's default torch.compile + CUDA graphs (--compiled)
#   skeletonk, skeletonck  the same two with B kept alive after its dump (--keep)
#   bench     spswap bench swap on 0.5B and 1.5B (BENCH_ARGS: more options, e.g.
#             "--kv-cache-gib 4"; BENCH_TAG: a suffix for bench.json)
#   tests     tests/engines/test_vllm.py and test_vllm_serve_gpu.py on 0.5B (TESTS: others;
#             TEST_FLAGS: pytest options, quoted as in a shell, e.g. "-v -k 'not damaged'")
#   bench7b   spswap bench swap on 7B (--cycles 2; BENCH_ARGS and BENCH_TAG too)
#   pcie      scripts/gpu/pcie_idle_probe.py (is a copy after an idle pause slow?)
#   regprobe  scripts/gpu/register_probe.py (does a CUDA restore pin a registered mapping
#             again; 4 KiB tmpfs pages against a tmpfs mounted huge=always)
#   pagefill  scripts/gpu/page_fill_probe.py (how fast a restore can fill fresh memory)
#   restorefill scripts/gpu/restore_fill_probe.sh (CRIU's restore, 4 KiB vs huge pages;
#             RESTOREFILL_MOUNTS="within_size always": the image on a tmpfs mounted with
#             each huge= in turn, alternating, instead of /dev/shm)
#   probe     scripts/gpu/vllm_copy_probe.py --first on 1.5B (PROBE_SIZE: another, e.g. 0.5b; why a copy runs below the limit;
#             PROBE_ARGS: other options, e.g. "--first-only --kv-gib 4")
#   apicuda   scripts/gpu/api_cuda_probe.py on 0.5B (why vLLM's API server process holds
#             CUDA state: the calls that start it, with their stacks; APICUDA_ENVS: variants)
#   release   scripts/gpu/release_probe.py (are copies slow after memory goes back to the driver?)
#   packsize  scripts/gpu/packed_size_probe.py, cudaMalloc'd then VMM blocks (does one copy
#             into a large fresh block run slower than in pieces? PACKSIZE_ARGS: its options)
#   sleepprobe scripts/gpu/sleep_probe.py on 1.5B (where a cycle's time goes inside vLLM;
#             SLEEP_PROBE_SIZES: others, e.g. "0.5b 1.5b"; SLEEP_PROBE_ARGS: its options,
#             e.g. "--kv-gib 4 --cycles 3 --pack")
#   asleep    scripts/gpu/asleep_probe.py on 0.5B (ASLEEP_SIZES: e.g. "0.5b 3b"), compiled then eager (what a sleeping vLLM
#             leaves on the GPU, what each trim saves, CUDA checkpoint/restore times;
#             ASLEEP_MODES: "compiled eager" by default; ASLEEP_ARGS: more options, e.g.
#             "--stack-bytes 1024 16 --ckpt-each" (both sizes timed on one engine) or
#             "--stack-bytes 16 --stack-back"; each probe needs 150 s of BUDGET_S left)
#   servecriu spswap serve --engine vllm preempted, dumped and restored with a real spswapd
#             (root, CRIU bundle, .device/serveaddon; test_vllm_serve_gpu.py), from its image
#             and kept alive (SERVECRIU_K: a pytest -k to run one of them)
# POOL_HUGE=1 puts the pools on a tmpfs mounted huge=within_size.
# Everything goes to $OUT (default /tmp/spswap-gpu-out). Each step has its own time limit
# and runs only while BUDGET_S seconds (default 560) leave room for it.
set -uo pipefail
OUT="${OUT:-/tmp/spswap-gpu-out}"
BUDGET_S="${BUDGET_S:-560}"
STEPS="${STEPS:-skeleton bench tests}"
MODELS=/tmp/spswap-models
POOL=/dev/shm/spswap-bench/pool
mkdir -p "$OUT"
# The pool belongs on tmpfs; a container's /dev/shm may be too small for it.
if [ "$(df -B1G --output=avail /dev/shm | tail -1)" -lt 40 ]; then POOL=/tmp/spswap-bench/pool; fi
# POOL_HUGE=1: the bench's and the tests' pools on a tmpfs of their own mounted
# huge=within_size, as docs/slurm.md recommends for SPSWAP_ROOT (entries in 2 MiB pages)
if [ "${POOL_HUGE:-0}" = 1 ]; then
  POOL=/tmp/spswap-bench-huge/pool
  mkdir -p /tmp/spswap-bench-huge
  mountpoint -q /tmp/spswap-bench-huge ||
    mount -t tmpfs -o huge=within_size,size=64G spswap-bench /tmp/spswap-bench-huge ||
    { echo "POOL_HUGE=1: could not mount a tmpfs"; exit 2; }
fi
echo "pool: $POOL; steps: $STEPS"
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
step() { echo "=== $1 (t=$(( $(date +%s) - start ))s)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
step kit
bash .device/vllmkit/install_kit.sh /tmp/kit || exit 2
export PYTHONPATH="/tmp/kit/site:$PWD"
# This machine's environment sets PYTHONDONTWRITEBYTECODE=1: without compiled bytecode each
# `spswap serve` the tests start compiles spswap's modules again (about 0.1 s of a restore's
# path that a site's install does not pay: install.sh compiles them)
python3 -m compileall -q spswap >/dev/null || echo "could not compile spswap's bytecode"
# vLLM's OpenAI server needs a few wheels the kit leaves out (uvicorn, ...): put them in
# .device/serveaddon (pip download --no-deps, see scripts/gpu/README.md) to serve.
if ls .device/serveaddon/*.whl >/dev/null 2>&1; then
  python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/kit/addon') for w in glob.glob('.device/serveaddon/*.whl')]"
  export PYTHONPATH="$PYTHONPATH:/tmp/kit/addon"
  python3 -c "import vllm.entrypoints.openai.api_server" 2>&1 | tail -1 | sed 's/^/api_server import: /'
fi
nvidia-smi --query-gpu=name,driver_version,persistence_mode,memory.total --format=csv
python3 -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__)"
df -h /tmp /dev/shm | tail -2

step models
sizes="0.5b 1.5b"
want bench7b && sizes="$sizes 7b"
for s in ${ASLEEP_SIZES:-}; do [[ " $sizes " == *" $s "* ]] || sizes="$sizes $s"; done
timeout -k 5 180 python3 scripts/gpu/make_models.py --out "$MODELS" --sizes $sizes || exit 3

# CRIU steps: the carried bundle, and no io_uring for the engines they start (restored after)
criu_on() {
  # The bundle travels packed when the kit and the server wheels leave no room for it.
  if [ ! -x .criu-build/bundle/criu ] && [ -f .device/criu-bundle.tar.xz ]; then
    mkdir -p .criu-build && tar -C .criu-build -xJf .device/criu-bundle.tar.xz
  fi
  if [ -z "${SPSWAP_CRIU:-}" ] && [ -x .criu-build/bundle/criu ]; then
    export SPSWAP_CRIU="$PWD/.criu-build/bundle/criu"
  fi
  old_uring=$(sysctl -n kernel.io_uring_disabled 2>/dev/null || echo 0)
  sysctl -w kernel.io_uring_disabled=2 || echo "could not set kernel.io_uring_disabled"
  "$SPSWAP_CRIU" --version | head -1
}
criu_off() { sysctl -w kernel.io_uring_disabled="$old_uring" >/dev/null 2>&1; }

if want pcie; then
  step pcie
  timeout -k 5 120 python3 scripts/gpu/pcie_idle_probe.py 2>&1 | grep IDLE
fi

if want restorefill; then
  step restorefill
  criu_on
  if [ -z "${RESTOREFILL_MOUNTS:-}" ]; then
    timeout -k 5 120 bash scripts/gpu/restore_fill_probe.sh 2048 3 | tee "$OUT/restorefill.jsonl"
  else
    for round in 1 2; do
      for huge in $RESTOREFILL_MOUNTS; do
        d=/tmp/spswap-rf-$huge
        mkdir -p "$d"
        mountpoint -q "$d" || mount -t tmpfs -o "huge=$huge,size=16G" spswap-rf "$d" ||
          { echo "restorefill: could not mount a huge=$huge tmpfs: skipped"; continue; }
        [ "$(left)" -gt 40 ] || { echo "restorefill: out of budget"; break 2; }
        WORK_DIR=$d timeout -k 5 $(( $(left) < 125 ? $(left) - 5 : 120 )) \
          bash scripts/gpu/restore_fill_probe.sh 2048 1 | tee -a "$OUT/restorefill.jsonl"
      done
    done
    for huge in $RESTOREFILL_MOUNTS; do umount "/tmp/spswap-rf-$huge" 2>/dev/null; done
  fi
  criu_off
fi

if want regprobe; then
  step regprobe
  dirs=/dev/shm/spswap-regprobe
  mkdir -p /tmp/spswap-huge
  if mount -t tmpfs -o huge=always,size=16G spswap-huge /tmp/spswap-huge; then
    dirs="$dirs /tmp/spswap-huge"
  else
    echo "regprobe: could not mount a huge=always tmpfs: 4 KiB pages only"
  fi
  timeout -k 5 300 python3 scripts/gpu/register_probe.py --sizes-gib 1 6 \
    --dirs $dirs 2>&1 | grep -v Warning | tee "$OUT/regprobe.jsonl"
  mountpoint -q /tmp/spswap-huge && umount /tmp/spswap-huge; rm -rf /dev/shm/spswap-regprobe
fi

if want pagefill; then
  step pagefill
  timeout -k 5 120 python3 scripts/gpu/page_fill_probe.py --size-mib 2048 --repeats 3 \
    | tee "$OUT/pagefill.jsonl"
fi

# run_skeleton STEP OUTPUT LIMIT_S [vllm_skeleton.py options]: 0.5B preempted for 1.5B
run_skeleton() {
  step "$1"
  criu_on
  timeout -k 5 "$3" python3 scripts/gpu/vllm_skeleton.py "${@:4}" \
    --model-a "$MODELS/qwen2-0.5b" --model-b "$MODELS/qwen2-1.5b" --out "$OUT/$2"
  echo "$1 rc=$?"
  criu_off
}
if want skeleton; then
  run_skeleton skeleton skeleton.json $(( $(left) < 280 ? $(left) : 280 ))
fi
if want skeletonk; then
  run_skeleton skeletonk skeleton-keep.json $(( $(left) < 280 ? $(left) : 280 )) --keep
fi
if want skeletonc; then
  # One compile thread: inductor's compile-worker pool would be part of the dumped tree.
  TORCHINDUCTOR_COMPILE_THREADS=1 run_skeleton skeletonc skeleton-compiled.json \
    $(( $(left) - 5 )) --compiled --step-timeout-s 240
fi
if want skeletonck; then
  TORCHINDUCTOR_COMPILE_THREADS=1 run_skeleton skeletonck skeleton-compiled-keep.json \
    $(( $(left) - 5 )) --compiled --keep --step-timeout-s 240
fi

if want servecriu; then
  step servecriu
  criu_on
  SPSWAP_TEST_VLLM_MODEL="$MODELS/qwen2-0.5b" timeout -k 5 $(( $(left) - 5 )) \
    python3 -m pytest tests/engines/test_vllm_serve_gpu.py -k "${SERVECRIU_K:-real_server_is_dumped}" -q -rs -s \
    -p no:cacheprovider
  echo "servecriu rc=$?"
  criu_off
fi

if want release; then
  step release
  timeout -k 5 120 python3 scripts/gpu/release_probe.py 2>&1 | grep "RELEASE\|Error"
  timeout -k 5 120 python3 scripts/gpu/release_probe.py --expandable 2>&1 | grep "RELEASE\|Error"
fi

if want packsize; then
  step packsize
  for flag in "" --expandable; do
    [ "$(left)" -gt 60 ] || { echo "packsize: out of budget"; break; }
    timeout -k 5 $(( $(left) < 245 ? $(left) - 5 : 240 )) python3 scripts/gpu/packed_size_probe.py \
      --dir "$(dirname "$POOL")/psp" ${PACKSIZE_ARGS:-} $flag 2>&1 | grep "PACKSIZE\|Error" \
      | tee -a "$OUT/packsize.jsonl"
  done
  rm -rf "$(dirname "$POOL")/psp"
fi

if want sleepprobe; then
  step sleepprobe
  for size in ${SLEEP_PROBE_SIZES:-1.5b}; do
    [ "$(left)" -gt 100 ] || { echo "sleepprobe: no time left for $size"; break; }
    timeout -k 5 $(( $(left) < 300 ? $(left) - 5 : 300 )) python3 scripts/gpu/sleep_probe.py "$MODELS/qwen2-$size" ${SLEEP_PROBE_ARGS:-} \
      2>&1 | grep "START\|INSTALL\|PACK\|ANSWERS\|CYCLE\|TIMELINE\|VERIFY\|Error\|error"
  done
fi

if want asleep; then
  step asleep
  for size in ${ASLEEP_SIZES:-0.5b}; do
    for mode in ${ASLEEP_MODES:-compiled eager}; do
      [ "$(left)" -gt 150 ] || break
      flag=""; [ "$mode" = eager ] && flag=--eager
      timeout -k 5 150 python3 scripts/gpu/asleep_probe.py "$MODELS/qwen2-$size" $flag ${ASLEEP_ARGS:-} 2>&1 \
        | grep "START\|MEM\|TREE\|LIMITS\|CKPT\|SMAPS\|Error\|error" | tee -a "$OUT/asleep.jsonl"
    done
  done
fi

if want apicuda; then
  step apicuda
  # APICUDA_ENVS: ';'-separated variants, each space-separated NAME=VALUE ("" = none)
  IFS=';' read -ra variants <<< "${APICUDA_ENVS:-;PYTORCH_NVML_BASED_CUDA_CHECK=1}"
  for v in "${variants[@]}"; do
    [ "$(left)" -gt 100 ] || break
    flags=""; for e in $v; do flags="$flags --env $e"; done
    timeout -k 5 $(( $(left) < 200 ? $(left) - 5 : 200 )) python3 scripts/gpu/api_cuda_probe.py \
      "$MODELS/qwen2-0.5b" $flags 2>&1 | grep "START\|TRACE\|PROC\|CKPT\|ERROR\|Error" \
      | tee -a "$OUT/apicuda.jsonl"
  done
fi
if want probe; then
  step probe
  timeout -k 5 "${PROBE_TIMEOUT_S:-150}" python3 scripts/gpu/vllm_copy_probe.py "$MODELS/qwen2-${PROBE_SIZE:-1.5b}" ${PROBE_ARGS:---first} \
    2>&1 | grep "PROBE\|PINNED\|FIRST\|VERIFY\|Error"
fi

if want bench && [ "$(left)" -gt 120 ]; then
  step bench
  timeout -k 5 $(( $(left) - 10 )) python3 -m spswap.cli bench swap \
    "$MODELS/qwen2-0.5b" "$MODELS/qwen2-1.5b" --pool-dir "$POOL" ${BENCH_ARGS:-} \
    --out "$OUT/bench${BENCH_TAG:-}.json"
  echo "bench rc=$?"
fi

if want tests && [ "$(left)" -gt 60 ]; then
  step tests
  criu_on  # test_vllm_serve_gpu.py dumps and restores the real server (else it skips)
  # TEST_FLAGS is read as the shell would (quotes kept): TEST_FLAGS="-k 'not damaged'"
  eval "test_flags=(${TEST_FLAGS:--q})"
  SPSWAP_TEST_VLLM_MODEL="$MODELS/qwen2-0.5b" SPSWAP_TEST_POOL="$POOL-tests" \
    timeout -k 5 $(( $(left) - 5 )) python3 -m pytest ${TESTS:-tests/engines/test_vllm.py \
    tests/engines/test_vllm_serve_gpu.py} "${test_flags[@]}" -rs -x -s \
    -p no:cacheprovider --junitxml="$OUT/tests.xml"
  echo "tests rc=$?"
  criu_off
  rm -rf "$POOL-tests"
fi

if want bench7b && [ "$(left)" -gt 150 ]; then
  step bench7b
  timeout -k 5 $(( $(left) - 5 )) python3 -m spswap.cli bench swap \
    "$MODELS/qwen2-7b" --pool-dir "$POOL" --cycles 2 ${BENCH_ARGS:-} \
    --out "$OUT/bench-7b${BENCH_TAG:-}.json"
  echo "7b rc=$?"
fi
step done

#!/usr/bin/env bash
# `spswap bench turns --engine vllm` on the GPU machine's Slurm (scripts/gpu/slurm_up.sh up
# first), run by a normal user as a user runs it: K models (default Qwen2-shaped 0.5B,
# 1.5B, 3B and a second 1.5B with other weights, peaked so greedy answers repeat), made
# by scripts/gpu/make_models.py, take R rounds of turns on the GPU, each in its own
# requeueable job from the vLLM template, vLLM in its default compiled mode (EAGER=1: eager). The report
# goes to $OUT/turns.json (and the table to stdout); the job logs to $OUT/logs.tgz.
#
#   OUT=/tmp/turns bash scripts/gpu/turns.sh
#
# Environment: SIZES ("0.5b 1.5b 3b 1.5b@7": SIZE[@SEED]), ROUNDS (3), KV_GIB (4),
# MODELS_DIR (/opt/spswap-models), SPSWAP_USER (spuser), VLLM_ARGS (extra vLLM options),
# CHECK (1: make_models.py --check first, with vLLM in eager mode), BENCH_TIMEOUT_S (3000),
# EAGER (1: vLLM eager, as `spswap serve` runs it by default; 0, the default: vLLM's own
# default, CUDA graphs and torch.compile, whose cold starts take longer).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
U=${SPSWAP_USER:-spuser}
OUT=${OUT:-/tmp/spswap-turns}
SIZES=${SIZES:-0.5b 1.5b 3b 1.5b@7}
ROUNDS=${ROUNDS:-3}
KV_GIB=${KV_GIB:-4}
MODELS_DIR=${MODELS_DIR:-/opt/spswap-models}
CHECK=${CHECK:-0}
HOME_U=$(getent passwd "$U" | cut -d: -f6)
WORK="$HOME_U/turns-$(date +%H%M%S)"
mkdir -p "$OUT" "$MODELS_DIR"
PY=/opt/spswap/venv/bin/python
[ -x "$PY" ] || PY=python3

models=()
for item in $SIZES; do
    size=${item%@*}; seed=0; [ "$item" != "$size" ] && seed=${item#*@}
    name="qwen2-$size"; [ "$seed" != 0 ] && name="$name-s$seed"
    if [ ! -f "$MODELS_DIR/$name/config.json" ]; then
        extra=(); [ "$CHECK" = 1 ] && extra=(--check)
        "$PY" "$REPO/scripts/gpu/make_models.py" --out "$MODELS_DIR" --sizes "$size" \
            --seed "$seed" "${extra[@]}" | tee -a "$OUT/models.jsonl" || { echo "turns: make_models failed for $item" >&2; exit 1; }
    fi
    models+=("$MODELS_DIR/$name")
done
chmod -R a+rX "$MODELS_DIR"

su - "$U" -c "mkdir -p -m 700 '$WORK'"
ARGS="--engine vllm --rounds $ROUNDS --partition low --kv-cache-gib $KV_GIB --work-dir '$WORK/w' --out '$WORK/turns.json'"
[ -n "${VLLM_ARGS:-}" ] && ARGS="$ARGS --vllm-args '$VLLM_ARGS'"
[ "${EAGER:-0}" = 1 ] && ARGS="$ARGS --eager"
t0=$(date +%s)
# bounded, so the logs below are collected even when a turn hangs
timeout "${BENCH_TIMEOUT_S:-3000}" su - "$U" -c "cd '$WORK' && spswap bench turns ${models[*]} $ARGS"
rc=$?
echo "turns: exit $rc after $(( $(date +%s) - t0 )) s"
cp "$WORK/turns.json" "$OUT/turns.json" 2>/dev/null
c="$OUT/collect"; mkdir -p "$c"
cp "$WORK"/w/*.log "$c/" 2>/dev/null
for d in "$WORK"/w/.spswap/*/; do
    [ -f "$d/vllm.log" ] && tail -n 200 "$d/vllm.log" > "$c/vllm-$(basename "$d").log"
    cp "$d/runs.jsonl" "$c/runs-$(basename "$d").jsonl" 2>/dev/null
done
SPSWAP_ROOT=${SPSWAP_ROOT:-/dev/shm/spswap} /opt/spswap/bin/spswap events -n 400 --json > "$c/events.json" 2>&1
cp /dev/shm/spswap/log/*.log /dev/shm/spswap/images/.logs/*.log "$c/" 2>/dev/null
tail -n 300 /tmp/spswap-slurm/log/slurmctld.log > "$c/slurmctld.log" 2>/dev/null
# slurmd's side of each turn's end (the step's end, the epilog, the requeue)
tail -n 5000 /tmp/spswap-slurm/log/slurmd.log > "$c/slurmd.log" 2>/dev/null
tar -C "$OUT" -czf "$OUT/logs.tgz" collect && rm -rf "$c"
exit $rc

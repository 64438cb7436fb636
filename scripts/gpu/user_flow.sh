#!/usr/bin/env bash
# The user's flow on the GPU machine's Slurm (scripts/gpu/slurm_up.sh up first), as a
# normal user, the way docs/slurm.md tells one to work: render
# sbatch_templates/serve_vllm.sbatch with only its CHANGE lines changed, sbatch it, ask it
# through the OpenAI API on its socket, preempt it with a job on the "high" partition, and
# ask the requeued run again from a client already waiting for it (the restored step's
# times run from the high job's own last line to that client's first answer; the
# script's own polls give polled_high_end_to_serving_s, as rows before 2026-12-05 were
# timed). Prints one JSON line per step ("FLOW {...}") and writes the
# job logs, spswap's events and Slurm's logs to $OUT. Exits non-zero when an answer
# differs or a step times out.
#
#   MODEL=/opt/spswap-models/qwen2-0.5b OUT=/tmp/flow bash scripts/gpu/user_flow.sh
#
# Environment: MODEL (a model directory the user can read; a missing qwen2-SIZE[-sSEED]
# is made by make_models.py first), SPSWAP_USER (spuser),
# VLLM_ARGS (the template's vLLM options), SERVE_ARGS (its spswap serve options; default
# "--units 4 --eager --max-model-len 512"; --no-eager for vLLM's CUDA graphs), HIGH_S
# (how long the high job holds the GPU, default 15), TIMEOUT_S (per wait, default 300).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
U=${SPSWAP_USER:-spuser}
MODEL=${MODEL:?set MODEL to a model directory}
OUT=${OUT:-/tmp/spswap-flow}
HIGH_S=${HIGH_S:-15}
TIMEOUT_S=${TIMEOUT_S:-300}
VLLM_ARGS=${VLLM_ARGS:---kv-cache-memory-bytes 4294967296}
SERVE_ARGS=${SERVE_ARGS:---units 4 --eager --max-model-len 512}
HOME_U=$(getent passwd "$U" | cut -d: -f6)
WORK="$HOME_U/flow"
mkdir -p "$OUT"
now() { date +%s.%N; }
flow() { echo "FLOW $1"; echo "$1" >> "$OUT/flow.jsonl"; }
as_user() { su - "$U" -c "$1"; }
die() { echo "user_flow: $*" >&2; collect; exit 1; }
# A fresh machine has no test models: make one named qwen2-SIZE[-sSEED] (as turns.sh
# does); any other missing directory is the caller's mistake, said before a job runs.
if [ ! -f "$MODEL/config.json" ]; then
    name=$(basename "$MODEL"); size=${name#qwen2-}; size=${size%-s*}; seed=0
    [[ "$name" == *-s* ]] && seed=${name##*-s}
    [[ "$name" == qwen2-* ]] || { echo "user_flow: no model at $MODEL (config.json): give MODEL=/opt/spswap-models/qwen2-0.5b to have one made" >&2; exit 2; }
    PY=/opt/spswap/venv/bin/python; [ -x "$PY" ] || PY=python3
    "$PY" "$REPO/scripts/gpu/make_models.py" --out "$(dirname "$MODEL")" --sizes "$size" \
        --seed "$seed" >> "$OUT/models.jsonl" || { echo "user_flow: make_models failed for $name" >&2; exit 2; }
    chmod -R a+rX "$(dirname "$MODEL")"
fi
collect() {  # everything into one archive (a device call brings back few files)
    local c="$OUT/collect"; mkdir -p "$c"
    cp "$WORK"/*.log "$c/" 2>/dev/null
    for d in "$WORK"/.spswap/*/; do [ -f "$d/vllm.log" ] && tail -n 300 "$d/vllm.log" > "$c/vllm-$(basename "$d").log"; done
    SPSWAP_ROOT=${SPSWAP_ROOT:-/dev/shm/spswap} /opt/spswap/bin/spswap events -n 200 --json > "$c/events.json" 2>&1
    tail -n 300 /tmp/spswap-slurm/log/slurmctld.log > "$c/slurmctld.log" 2>/dev/null
    tail -n 300 /tmp/spswap-slurm/log/slurmd.log > "$c/slurmd.log" 2>/dev/null
    cp /dev/shm/spswap/log/*.log /dev/shm/spswap/images/.logs/*.log "$c/" 2>/dev/null
    squeue -o '%i %P %T %r %M' > "$c/squeue.txt" 2>&1
    cp "$OUT/template.diff" "$c/" 2>/dev/null
    tar -C "$OUT" -czf "$OUT/logs.tgz" collect && rm -rf "$c"
}
wait_for() {  # description, shell test; polls every 0.1 s up to TIMEOUT_S
    local deadline=$(( $(date +%s) + TIMEOUT_S ))
    until eval "$2"; do
        [ "$(date +%s)" -lt "$deadline" ] || die "timed out waiting for $1"
        sleep 0.1
    done
}

# 1. The user renders the template: only the CHANGE lines differ.
# A umask of 002 (Ubuntu's useradd) makes group-writable folders, which spswap refuses
# for state: the user works in a private one, as the template's comment says.
as_user "mkdir -p -m 700 '$WORK' && chmod 700 '$WORK'"
serve_sed=()
[ -n "$SERVE_ARGS" ] && serve_sed=(-e "s|^SERVE_ARGS=(.*)   # CHANGE|SERVE_ARGS=($SERVE_ARGS)   # CHANGE|")
sed -e "s|^MODEL=/path/to/model |MODEL=$MODEL |" \
    -e "s|^VLLM_ARGS=(.*)   # CHANGE|VLLM_ARGS=($VLLM_ARGS)   # CHANGE|" "${serve_sed[@]}" \
    "$REPO/sbatch_templates/serve_vllm.sbatch" > "$WORK/serve.sbatch"
diff "$REPO/sbatch_templates/serve_vllm.sbatch" "$WORK/serve.sbatch" > "$OUT/template.diff"
# every substitution took (MODEL, VLLM_ARGS, and SERVE_ARGS where given), nothing else
changed=4; [ -n "$SERVE_ARGS" ] && changed=6
[ "$(grep -c '^[<>]' "$OUT/template.diff")" = "$changed" ] \
    && ! grep '^[<>]' "$OUT/template.diff" | grep -qv '   # CHANGE' \
    || die "the rendered template differs in more (or less) than its CHANGE lines"
chown "$U:" "$WORK/serve.sbatch"
cat > "$WORK/high.sbatch" <<EOF
#!/bin/bash
#SBATCH --partition=high --gres=gpu:1 --output=high-%j.log
echo "high start \$(date +%s.%N)"
python3 -c "import torch; torch.ones(1, device='cuda'); print('high on', torch.cuda.get_device_name(0))"
sleep $HIGH_S
echo "high end \$(date +%s.%N)"
EOF
chown "$U:" "$WORK/high.sbatch"

# The answers: token-id prompts (the test models have no tokenizer), greedy.
cat > "$WORK/ask.py" <<'EOF'
import http.client, json, socket, sys, time
class UDS(http.client.HTTPConnection):
    def __init__(self, path): super().__init__("localhost", timeout=120); self.path_ = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX); self.sock.connect(self.path_)
def ask(uds, model, prompt, n):
    c = UDS(uds)
    c.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": prompt,
              "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
              "return_token_ids": True}), {"Content-Type": "application/json"})
    r = c.getresponse(); body = json.loads(r.read())
    if r.status != 200: print(json.dumps({"error": body})); sys.exit(1)
    return body["choices"][0]["token_ids"]
if sys.argv[1] == "times":  # an answer's time against its length: per request + per token
    uds, model, t = sys.argv[2], sys.argv[3], {}
    for n in (1, 2, 4, 8, 16, 32):
        runs = []
        for _ in range(3):
            t0 = time.monotonic(); ask(uds, model, [1, 2, 3, 4, 5], n)
            runs.append(time.monotonic() - t0)
        t[n] = sorted(runs)[1]
    per_token = (t[32] - t[2]) / 30
    print(json.dumps({"median_s": {str(n): round(v, 4) for n, v in t.items()},
                      "per_token_ms": round(per_token * 1000, 2),
                      "per_request_ms": round((t[2] - 2 * per_token) * 1000, 1)}))
    sys.exit(0)
uds, model = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3:  # a client already running, as a user's eval loop: it waits for the
    ep = sys.argv[3]   # run's endpoint.json (written once it serves), then asks at once
    while True:
        try:
            uds = json.load(open(ep))["uds"]; break
        except (OSError, ValueError, KeyError):
            time.sleep(0.005)
    seen_at = time.time()
out = []
t0 = time.monotonic()
for p in ([1, 2, 3, 4, 5], [10, 20, 30], [7] * 16):
    out.append(ask(uds, model, p, 16))
    if len(out) == 1: first_s, first_at = time.monotonic() - t0, time.time()
print(json.dumps({"answers": out, "first_answer_s": round(first_s, 3),
                  "first_answer_at": round(first_at, 3),
                  **({"serving_seen_at": round(seen_at, 3)} if len(sys.argv) > 3 else {})}))
EOF
chown "$U:" "$WORK/ask.py"

# 2. Submit; wait until it serves; ask.
t_sub=$(now)
JOB=$(as_user "cd '$WORK' && sbatch --parsable serve.sbatch") || die "sbatch failed"
flow "{\"step\": \"submitted\", \"job\": $JOB}"
EP="$WORK/.spswap/$JOB/endpoint.json"
wait_for "run 0 to serve" "[ -s '$EP' ]"
t_up=$(now)
UDS=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['uds'])" "$EP")
PID0=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" "$EP")
A0=$(as_user "python3 '$WORK/ask.py' '$UDS' '$MODEL'") || die "run 0 did not answer: $A0"
flow "{\"step\": \"cold\", \"submit_to_serving_s\": $(python3 -c "print(round($t_up-$t_sub,2))"), \"ask\": $A0}"
# how long an answer takes against its length (what a first answer's time is made of)
T0=$(as_user "python3 '$WORK/ask.py' times '$UDS' '$MODEL'") && flow "{\"step\": \"answer_times\", \"run\": 0, \"times\": $T0}"

# 3. A higher job preempts it; spswap parks and checkpoints it; Slurm requeues it.
t_pre=$(now)
HJOB=$(as_user "cd '$WORK' && sbatch --parsable high.sbatch") || die "high sbatch failed"
wait_for "the high job to start" "grep -q 'high start' '$WORK/high-$HJOB.log' 2>/dev/null"
t_high=$(now)
flow "{\"step\": \"preempted\", \"high_job\": $HJOB, \"sbatch_to_high_start_s\": $(python3 -c "print(round($t_high-$t_pre,2))")}"
wait_for "run 0 to park" "[ ! -e '$EP' ]"
# 4. The requeued run restores the server (same pid) and answers. The user's client is
# already running and waiting (as an evaluation loop would be), so the first answer's time
# is the product's, not this script's `su` and Python start (0.3-0.4 s, in earlier rows).
as_user "cd '$WORK' && nohup python3 ask.py - '$MODEL' '$EP' > ask1.json 2> ask1.err &"
wait_for "the high job to end" "! squeue -h -j $HJOB 2>/dev/null | grep -q ."
t_hend=$(now)
# the high job's own last line: its end by its own clock, not this script's 0.1 s polls
t_hend_own=$(awk '/^high end/ {print $3}' "$WORK/high-$HJOB.log")
[ -n "$t_hend_own" ] || t_hend_own=$t_hend
# endpoint.json exists only while a run serves: gone at the park, back once restored.
wait_for "run 1 to serve" "[ -s '$EP' ]"
t_up1=$(now)
wait_for "the waiting client's answers" "[ -s '$WORK/ask1.json' ] || [ -s '$WORK/ask1.err' ]"
sleep 0.2  # (its last line written)
A1=$(cat "$WORK/ask1.json")
[ -n "$A1" ] || die "run 1 did not answer: $(cat "$WORK/ask1.err")"
# the first answer's own clock (ask.py's), not the end of all three answers
t_ans1=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['first_answer_at'])" "$A1")
t_seen1=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['serving_seen_at'])" "$A1")
same=$(python3 -c "import json,sys; print(str(json.loads(sys.argv[1])['answers'] == json.loads(sys.argv[2])['answers']).lower())" "$A0" "$A1")
# how run 1 came back (kept, image, pool, cold): its line in the state dir's runs.jsonl
HOW=$(python3 -c "import json,sys; print([json.loads(l)['path'] for l in open(sys.argv[1]) if json.loads(l)['restart_count'] == 1][-1])" "$WORK/.spswap/$JOB/runs.jsonl" 2>/dev/null || echo unknown)
flow "{\"step\": \"restored\", \"path\": \"$HOW\", \"high_end_to_serving_s\": $(python3 -c "print(round($t_seen1-$t_hend_own,2))"), \"high_end_to_first_answer_s\": $(python3 -c "print(round($t_ans1-$t_hend_own,2))"), \"polled_high_end_to_serving_s\": $(python3 -c "print(round($t_up1-$t_hend,2))"), \"identical\": $same, \"ask\": $A1}"
UDS1=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['uds'])" "$EP")
T1=$(as_user "python3 '$WORK/ask.py' times '$UDS1' '$MODEL'") && flow "{\"step\": \"answer_times\", \"run\": 1, \"times\": $T1}"
# the restore's steps after the high job's end (spswapd's events, the client's clock)
TL=$(SPSWAP_ROOT=${SPSWAP_ROOT:-/dev/shm/spswap} /opt/spswap/bin/spswap events -n 200 --json 2>/dev/null \
    | python3 "$REPO/scripts/gpu/flow_timeline.py" "$JOB" "$t_hend_own" "$t_seen1" "$t_ans1" 2>/dev/null || echo '{}')
flow "{\"step\": \"timeline\", \"job\": $JOB, \"steps\": $TL}"
# what the job's image held (spswapd's checkpoint.saved event), by kind of memory (its
# checkpoint.layout event, recorded right after)
IMG=$(SPSWAP_ROOT=${SPSWAP_ROOT:-/dev/shm/spswap} /opt/spswap/bin/spswap events -n 200 --json 2>/dev/null | python3 -c "import json,sys; ev=[e for e in json.load(sys.stdin) if e.get('job_id')=='$JOB']; s=[e['detail']['image'] for e in ev if e['kind']=='checkpoint.saved']; l=[e['detail']['layout'] for e in ev if e['kind']=='checkpoint.layout']; i=s[-1] if s else {}; lay=l[-1] if l else {}; print(json.dumps({'size_bytes': i.get('size_bytes'), 'kept': i.get('kept'), 'bytes_by_kind': lay.get('bytes_by_kind'), 'processes': [(p['pid'], p['dumped_bytes'], p['bytes_by_kind']) for p in lay.get('processes', [])]}))" 2>/dev/null || echo '{}')
flow "{\"step\": \"image\", \"job\": $JOB, \"image\": $IMG}"
collect
grep -h "restore\|checkpoint\|cold\|run 1" "$WORK"/spswap-vllm-"$JOB".log | tail -n 20
as_user "scancel $JOB"
[ "$same" = true ] || { echo "user_flow: answers differ after the restore" >&2; exit 1; }
echo "user_flow: ok"

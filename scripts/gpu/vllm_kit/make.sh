#!/usr/bin/env bash
# Build the vLLM kit: vLLM 0.26.0 (its CUDA-13 wheel from PyPI) stripped to what offline
# generation on an H100/H200 (sm_90) needs, plus the dependency wheels (deps.txt) that a GPU
# machine with torch 2.11.0+cu130 but no vLLM lacks, as ONE ready site dir packed in tar.xz
# parts; then, as a second step, the wheels vLLM's OpenAI server needs beyond the kit.
#
# Why: the GPU machine has no internet and no usable pip index, and a device call carries at
# most 64 MiB. vLLM 0.26.0 is the last release that pins torch==2.11.0 and so runs on that
# machine's own torch; the stripped kit is ~38 MB of xz (NO_MOE=1), ~52 MB with MoE kernels.
#
# Usage, on a machine with internet (the CPU machine), from anywhere:
#
#   bash scripts/gpu/vllm_kit/make.sh          # 2-3 min; downloads from PyPI unless cached
#
# Output (both folders must stay git-ignored: never commit them):
#   $KIT (default .device/vllmkit):
#     site.tar.xz.partNN  vllm + deps; unpack with install_kit.sh (a copy of install.sh):
#                         bash .device/vllmkit/install_kit.sh /tmp/kit, then
#                         PYTHONPATH=/tmp/kit/site (no pip needed on the GPU machine)
#     SHA256SUMS, MANIFEST.txt (the dependency wheel files), deps.txt
#   $SERVE_DIR (default .device/serveaddon): the OpenAI server's extra wheels
#     (uvicorn ...; ~5 MB), which scripts/gpu/run_vllm.sh unpacks after the kit.
# Relative KIT / SERVE_DIR are taken from the current directory; the defaults are under the
# project root.
#
# What is stripped from the vllm wheel:
#   FlashAttention-2 (305 MB, sm_80 only; FA3 (sm_90) stays: its cubins xz to ~8 MB), the
#   vllm-rs Rust HTTP frontend (43 MB), Blackwell FMHA and DeepGEMM headers, FlashMLA,
#   qutlass (FP4), the swagger UI, deep_gemm _C for other Pythons, RECORD. In
#   _C_stable_libtorch (and _moe_C_stable_libtorch) the GPU code for archs other than sm_90
#   is zeroed by prune_fatbin.py: same file layout, H100/H200 only.
#
# Knobs (environment):
#   KIT=DIR          kit output folder (.device/vllmkit)
#   NO_MOE=1         drop _moe_C (default 1: only MoE models need it; 0 adds ~14 MB of xz)
#   NO_FA3=1         drop FlashAttention-3 (then use attention_config={"backend": "TRITON_ATTN"})
#   NO_PRUNE=1       keep the GPU code of all archs (~115 MB: no longer fits one device call)
#   VLLM_VERSION     (0.26.0; deps.txt is pinned for this one)
#   WHEEL_CACHE=DIR  downloaded wheels, reused across builds (/tmp/vllmkit-cache); with every
#                    pinned wheel there the build needs no network
#   PART_MB          size of one part in MiB (60)
#   SERVE_ADDON=0    skip the server wheels (default 1)
#   SERVE_DIR=DIR    where they go (.device/serveaddon)
#   PY               the Python whose pip downloads and installs the wheels (python3)
#   XZ_OPT           xz options (-9e)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
KIT="${KIT:-$ROOT/.device/vllmkit}"
SERVE_DIR="${SERVE_DIR:-$ROOT/.device/serveaddon}"
NO_MOE="${NO_MOE:-1}"
NO_FA3="${NO_FA3:-0}"
NO_PRUNE="${NO_PRUNE:-0}"
SERVE_ADDON="${SERVE_ADDON:-1}"
VLLM_VERSION="${VLLM_VERSION:-0.26.0}"
WHEEL_CACHE="${WHEEL_CACHE:-/tmp/vllmkit-cache}"
PART_MB="${PART_MB:-60}"
PY="${PY:-python3}"
XZ_OPT="${XZ_OPT:--9e}"

# The wheels vLLM's OpenAI server (vllm.entrypoints.openai.api_server) needs beyond the kit,
# found by importing it on the H200, whose image has the rest.
SERVE_WHEELS=(uvicorn==0.54.0 h11==0.16.0 click==8.5.1 prometheus-fastapi-instrumentator==8.1.0
    python-multipart==0.0.34 watchfiles==1.3.0 python-json-logger==4.2.0 email-validator==2.4.0
    dnspython==2.9.2 anthropic==2.15.0 mcp==2.3.0 sse-starlette==3.7.0 httpx-sse==0.4.3
    pydantic-settings==2.16.3 python-dotenv==1.2.4 jiter==0.19.0 docstring-parser==0.18.0
    distro==1.9.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 ijson==3.6.0)

die() { echo "make: $*" >&2; exit 1; }
say() { echo "make: $*"; }

for tool in unzip xz tar split sha256sum; do
    command -v "$tool" >/dev/null || die "$tool is missing (apt-get install $tool)"
done
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip (set PY to a Python with pip)"
[ -f "$HERE/deps.txt" ] || die "no $HERE/deps.txt"

# An output folder inside the work tree must be git-ignored: the kit must never be committed.
check_ignored() {
    local dir; dir="$(cd "$1" && pwd)"
    case "$dir/" in
        "$ROOT"/*)
            git -C "$ROOT" check-ignore -q "$dir" \
                || die "$dir is inside the work tree but not git-ignored: ignore it first" ;;
    esac
}

# The platform of the GPU machine's Python: CPython 3.12, glibc 2.35, x86_64.
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# pinned_wheel DIR NAME==VERSION: the wheel file of exactly that version in DIR, or nothing.
# (Wheel file names spell the project name with runs of '-_.' as '_', in any case.)
pinned_wheel() {
    local name="${2%%==*}" ver="${2##*==}" f
    name="$(echo "$name" | sed -E 's/[-_.]+/_/g' | tr 'A-Z' 'a-z')"
    for f in "$1"/*.whl; do
        [ -e "$f" ] || continue
        case "$(basename "$f" | tr 'A-Z' 'a-z')" in
            "$name-$ver-"*) echo "$f"; return 0 ;;
        esac
    done
}

# fetch_pinned DIR PIP_PLATFORM_ARGS... -- REQ...: every REQ's wheel in DIR, downloading only
# those not there yet; prints their paths, in REQ order.
fetch_pinned() {
    local dir="$1"; shift
    local plat=() reqs=() missing=() req f
    while [ "$1" != -- ]; do plat+=("$1"); shift; done; shift
    reqs=("$@")
    for req in "${reqs[@]}"; do
        [ -n "$(pinned_wheel "$dir" "$req")" ] || missing+=("$req")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "make: downloading ${#missing[@]} wheels into $dir" >&2
        "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$dir" "${missing[@]}" >&2 \
            || die "pip download failed for: ${missing[*]}"
    fi
    for req in "${reqs[@]}"; do
        f="$(pinned_wheel "$dir" "$req")"
        [ -n "$f" ] || die "no wheel for $req in $dir after the download"
        echo "$f"
    done
}

WORK="$(mktemp -d /tmp/vllmkit-build.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WHEEL_CACHE/deps" "$KIT"
check_ignored "$KIT"
KIT="$(cd "$KIT" && pwd)"
rm -f "$KIT"/site.tar.xz.part* "$KIT"/SHA256SUMS "$KIT"/MANIFEST.txt

# ---- 1. the vllm wheel --------------------------------------------------------------
WHL="$(ls "$WHEEL_CACHE"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$WHL" ]; then
    say "downloading vllm==$VLLM_VERSION (~500 MB)"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d "$WHEEL_CACHE" "vllm==$VLLM_VERSION" \
        || die "pip download vllm==$VLLM_VERSION failed"
    WHL="$(ls "$WHEEL_CACHE"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)"
    [ -n "$WHL" ] || die "no vllm-$VLLM_VERSION wheel in $WHEEL_CACHE after the download"
fi
say "vllm wheel: $WHL ($(du -h "$WHL" | cut -f1))"

# ---- 2. unpack it without the heavy optional parts ----------------------------------
SITE="$WORK/site"
mkdir -p "$SITE"
EXCL=('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'            # 305 MB FlashAttention-2 (sm_80)
      'vllm/vllm-rs'                                        #  43 MB Rust HTTP frontend
      'vllm/third_party/fmha_sm100/*'                       # Blackwell FMHA headers
      'vllm/third_party/deep_gemm/include/*'                # DeepGEMM JIT headers
      'vllm/third_party/deep_gemm/_C.cpython-31[0134]-*'    # deep_gemm for other Pythons
      'vllm/_flashmla_C.abi3.so' 'vllm/_flashmla_extension_C.abi3.so'  # MLA (DeepSeek)
      'vllm/_qutlass_C.abi3.so'                             # FP4 kernels
      'vllm/entrypoints/serve/instrumentator/static/*'      # swagger UI
      'vllm-*.dist-info/RECORD')
[ "$NO_MOE" = 1 ] && EXCL+=('vllm/_moe_C_stable_libtorch.abi3.so')
[ "$NO_FA3" = 1 ] && EXCL+=('vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so')  # 146 MB, ~8 MB of xz
unzip -q "$WHL" -d "$SITE" -x "${EXCL[@]}" || die "unzip $WHL failed"

# vllm_flash_attn/__init__.py raises ImportError when no FA .so is there, and
# vllm/v1/attention/backends/fa_utils.py imports it at module level on CUDA. Keep the package
# importable: FA then reports itself unavailable. (Only matters with NO_FA3=1; with FA3 there
# the condition is false anyway.)
"$PY" - "$SITE/vllm/vllm_flash_attn/__init__.py" <<'EOF' || die "patching vllm_flash_attn failed"
import sys
from pathlib import Path

path = Path(sys.argv[1])
text = path.read_text()
old = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
if old not in text:
    sys.exit(f"{path}: the FA availability check changed; revisit this patch")
new = "if False and not (FA2_AVAILABLE or FA3_AVAILABLE):  # vllmkit: FA .so stripped\n"
path.write_text(text.replace(old, new + "    raise ImportError("))
EOF

# The GPU code for other archs -> zeros (compresses to nothing). H100/H200 only.
if [ "$NO_PRUNE" != 1 ]; then
    SOS=("$SITE/vllm/_C_stable_libtorch.abi3.so")
    MOE_SO="$SITE/vllm/_moe_C_stable_libtorch.abi3.so"
    if [ -f "$MOE_SO" ]; then SOS+=("$MOE_SO"); fi
    "$PY" "$HERE/prune_fatbin.py" "${SOS[@]}" | sed "s|$SITE/||"
fi

# ---- 3. the dependency wheels, installed into the same site dir ---------------------
mapfile -t DEPS < <(grep -v '^[[:space:]]*#' "$HERE/deps.txt" | grep -v '^[[:space:]]*$')
[ ${#DEPS[@]} -gt 0 ] || die "deps.txt lists no wheels"
mapfile -t FILES < <(fetch_pinned "$WHEEL_CACHE/deps" "${PLAT[@]}" -- "${DEPS[@]}")
[ ${#FILES[@]} = ${#DEPS[@]} ] || die "could not get every wheel in deps.txt"
"$PY" -m pip install -q --no-deps --no-compile --no-index --root-user-action=ignore \
    "${PLAT[@]}" --target "$SITE" "${FILES[@]}" \
    || die "pip install --target of the dependency wheels failed"
rm -rf "$SITE/bin"
find "$SITE" -name '__pycache__' -prune -exec rm -rf {} +
printf '%s\n' "${FILES[@]##*/}" > "$KIT/MANIFEST.txt"
say "site: $(du -sh "$SITE" | cut -f1)"

# ---- 4. compress and split ----------------------------------------------------------
(cd "$SITE" && tar --owner=0 --group=0 --sort=name -cf - .) | xz -T0 $XZ_OPT > "$WORK/site.tar.xz"
split -b "${PART_MB}M" -d -a 2 "$WORK/site.tar.xz" "$KIT/site.tar.xz.part"
(cd "$KIT" && sha256sum site.tar.xz.part* > SHA256SUMS)
cp "$HERE/deps.txt" "$KIT/deps.txt"
cp "$HERE/install.sh" "$KIT/install_kit.sh"   # the name scripts/gpu/run_vllm.sh calls
say "kit in $KIT: $(ls "$KIT"/site.tar.xz.part* | wc -l) part(s), $(du -sh "$KIT" | cut -f1)"

# ---- 5. the OpenAI server's extra wheels --------------------------------------------
if [ "$SERVE_ADDON" = 1 ]; then
    mkdir -p "$WHEEL_CACHE/serve" "$SERVE_DIR"
    check_ignored "$SERVE_DIR"
    mapfile -t SFILES < <(fetch_pinned "$WHEEL_CACHE/serve" --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
        -- "${SERVE_WHEELS[@]}")
    [ ${#SFILES[@]} = ${#SERVE_WHEELS[@]} ] || die "could not get every server wheel"
    rm -f "$SERVE_DIR"/*.whl   # run_vllm.sh unpacks every wheel there: no stale versions
    cp "${SFILES[@]}" "$SERVE_DIR/"
    say "server wheels in $SERVE_DIR: ${#SFILES[@]}, $(du -sh "$SERVE_DIR" | cut -f1)"
fi
ls -l "$KIT"

#!/usr/bin/env bash
# Build CRIU >= 4.1 from source, through apt only, when the installed one is missing or too old.
#
# Why: Linux >= 6.13 splits [vvar] into [vvar] and [vvar_vclock]; CRIU learned that in 4.1.
# Debian 12 ships 3.17.1, which fails every command on such kernels ("Unexpected rt vDSO
# area bounds"). Debian trixie carries 4.1.1, whose binary package needs a newer glibc, but
# whose upstream tarball builds fine on Debian 12. We fetch that tarball with apt-get source
# through a private deb-src list (the machine's apt setup is left untouched), check its sha256,
# build only the `criu` binary and install it.
#
# Usage: scripts/build_criu.sh [--prefix DIR] [--build-dir DIR] [--bundle DIR] [--force]
#   --prefix DIR     install to DIR/sbin/criu (default /usr/local, or $PREFIX)
#   --build-dir DIR  where the source is fetched and built (default $CRIU_BUILD_DIR or
#                    /var/cache/spswap/criu-build)
#   --bundle DIR     also copy the binary and the shared libraries it needs (those not part of
#                    glibc) into DIR, stripped, with a wrapper DIR/criu that sets
#                    LD_LIBRARY_PATH: carry DIR to a node that has no CRIU.
#   --force          build even when a good CRIU is already installed
#   --stamp          print the patches a good build has (name:sha256 prefix) and exit
# Idempotent: with CRIU >= 4.1 already on PATH or in the prefix, it only prints the version
# (and makes the bundle when asked).
set -euo pipefail

# The version trixie carried when this was written, and its tarball's sha256. When trixie
# moves on, whatever >= 4.1 apt downloads is built instead (apt checks it against the
# signed Sources index); the pinned sha256 applies to this version only.
CRIU_VERSION=4.1.1
CRIU_TARBALL="criu_${CRIU_VERSION}.orig.tar.xz"
CRIU_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
APT=(apt-get -o DPkg::Lock::Timeout=600)
MIN_MAJOR=4
MIN_MINOR=1
BUILD_PACKAGES=(
  build-essential pkg-config xz-utils patch
  libbsd-dev libcap-dev libdrm-dev libnet1-dev libnl-3-dev libnl-route-3-dev
  libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler
  libaio-dev libnftables-dev libgnutls28-dev uuid-dev
)

PREFIX="${PREFIX:-/usr/local}"
PATCH_DIR="$(cd "$(dirname "$0")" && pwd)/criu-patches"
BUILD_DIR="${CRIU_BUILD_DIR:-/var/cache/spswap/criu-build}"
BUNDLE_DIR=""
FORCE=0
STAMP_ONLY=0

die() { echo "build_criu: error: $*" >&2; exit 1; }
log() { echo "build_criu: $*" >&2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefix) PREFIX="$2"; shift 2 ;;
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --bundle) BUNDLE_DIR="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    --stamp) STAMP_ONLY=1; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

# Prints "MAJOR MINOR" of a criu binary, or nothing when it cannot say.
criu_version_of() {
  local out
  out="$("$1" --version 2>/dev/null || true)"
  sed -n 's/^Version: *\([0-9]\+\)\.\([0-9]\+\).*/\1 \2/p' <<<"$out" | head -n1
}

# What the stamp beside a build says: each patch's name and the start of its sha256, so a
# patch edited under the same name makes the build stale too.
patch_stamp() {
  local p
  for p in $(ls -1 "$PATCH_DIR"/*.patch 2>/dev/null | sort); do
    printf '%s:%s ' "$(basename "$p")" "$(sha256sum "$p" | cut -c1-12)"
  done
}
[[ $STAMP_ONLY -eq 0 ]] || { patch_stamp; echo; exit 0; }
stamp_file() { echo "$PREFIX/share/spswap/criu-patches"; }

is_good() {
  local v major minor
  v="$(criu_version_of "$1")"
  [[ -n "$v" ]] || return 1
  read -r major minor <<<"$v"
  (( major > MIN_MAJOR || (major == MIN_MAJOR && minor >= MIN_MINOR) )) || return 1
  # 4.1.x fails on TCP sockets under Linux >= 6.16 unless built here with our patches
  if (( major == 4 && minor == 1 )); then
    [[ "$1" == "$PREFIX/sbin/criu" && -f "$(stamp_file)" \
       && "$(cat "$(stamp_file)")" == "$(patch_stamp)" ]] || return 1
  fi
  return 0
}

find_good_criu() {
  local c
  for c in "$PREFIX/sbin/criu" "$(command -v criu 2>/dev/null || true)"; do
    if [[ -n "$c" && -x "$c" ]] && is_good "$c"; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

# The Debian mirror this machine already uses, so the build works behind the same proxy/mirror.
debian_mirror() {
  local uri=""
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    uri="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)"
  fi
  if [[ -z "$uri" && -f /etc/apt/sources.list ]]; then
    uri="$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list)"
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

install_build_packages() {
  local missing=() p
  for p in "${BUILD_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  log "installing build packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${APT[@]}" install -y --no-install-recommends "${missing[@]}" >&2 \
    || { "${APT[@]}" update >&2 && "${APT[@]}" install -y --no-install-recommends "${missing[@]}" >&2; } \
    || die "could not install the build packages ${missing[*]}; install them and run again"
}

fetch_tarball() {
  local apt_dir="$BUILD_DIR/apt" mirror
  local tarball="$BUILD_DIR/$CRIU_TARBALL"
  if [[ -f "$tarball" ]] && echo "$CRIU_SHA256  $tarball" | sha256sum -c --status; then
    return 0
  fi
  mirror="$(debian_mirror)"
  mkdir -p "$apt_dir/lists/partial"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
    >"$apt_dir/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$apt_dir/lists")
  log "fetching the criu source list of trixie from $mirror"
  apt-get "${opts[@]}" update >&2 || die "apt-get update of the private trixie deb-src list failed"
  # Only the orig tarball is needed; apt may fail on the .dsc / debian.tar.xz, which we ignore
  # and judge by the tarball's checksum instead.
  (cd "$BUILD_DIR" && apt-get "${opts[@]}" source --download-only criu >&2) || true
  if [[ ! -f "$tarball" ]]; then
    # trixie has moved on: take the newest orig tarball apt fetched, if it is >= 4.1
    local found ver
    found="$(ls -1 "$BUILD_DIR"/criu_*.orig.tar.* 2>/dev/null | sort -V | tail -1 || true)"
    [[ -n "$found" ]] || die "apt did not download a criu source tarball from trixie on $mirror; check the mirror, or install criu >= 4.1 yourself"
    ver="$(basename "$found" | sed -E 's/^criu_([0-9.]+)\.orig\.tar\..*$/\1/')"
    [[ "$(printf '%s\n' "$MIN_MAJOR.$MIN_MINOR" "$ver" | sort -V | head -1)" == "$MIN_MAJOR.$MIN_MINOR" ]] \
      || die "trixie offers criu $ver, older than $MIN_MAJOR.$MIN_MINOR"
    log "trixie now carries criu $ver (not $CRIU_VERSION): building that"
    CRIU_VERSION="$ver"; CRIU_TARBALL="$(basename "$found")"
    return 0
  fi
  echo "$CRIU_SHA256  $tarball" | sha256sum -c --status \
    || die "$tarball has the wrong sha256 (expected $CRIU_SHA256); delete it and run again"
}

build() {
  local src="$BUILD_DIR/criu-$CRIU_VERSION"
  # from a clean tree: one patched by an older version of a patch would not take the new
  rm -rf "$src"
  tar -C "$BUILD_DIR" -xf "$BUILD_DIR/$CRIU_TARBALL"
  [[ -f "$src/Makefile" ]] || die "the tarball did not unpack to $src"
  local p applied=""
  for p in "$PATCH_DIR"/*.patch; do
    [[ -f "$p" ]] || continue
    # the patches are for 4.1.x; a newer CRIU that trixie moves to has its own fixes
    [[ "$CRIU_VERSION" == 4.1.* ]] || { log "$(basename "$p") is for 4.1.x: skipped"; continue; }
    if patch -d "$src" -p1 --forward --dry-run -s <"$p" >/dev/null 2>&1; then
      patch -d "$src" -p1 --forward -s <"$p" || die "could not apply $p"
      log "applied $(basename "$p")"
      applied+="$(basename "$p"):$(sha256sum "$p" | cut -c1-12) "
    else
      die "$(basename "$p") does not apply to criu $CRIU_VERSION; install a CRIU that has the fix and run again"
    fi
  done
  log "building criu $CRIU_VERSION in $src with $(nproc) jobs"
  make -C "$src" -j"$(nproc)" criu >"$BUILD_DIR/build.log" 2>&1 \
    || { tail -n 30 "$BUILD_DIR/build.log" >&2; die "make failed; full log in $BUILD_DIR/build.log"; }
  install -D -m 0755 "$src/criu/criu" "$PREFIX/sbin/criu"
  mkdir -p "$(dirname "$(stamp_file)")"
  echo -n "$applied" >"$(stamp_file)"
}

# Libraries of glibc itself: every Linux node has a compatible one, so they never travel.
is_base_lib() {
  case "$(basename "$1")" in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*|ld-linux*|linux-vdso*) return 0 ;;
    *) return 1 ;;
  esac
}

make_bundle() {
  local bin="$1" dir="$2" lib
  mkdir -p "$dir/bin" "$dir/lib"
  install -m 0755 "$bin" "$dir/bin/criu"
  strip "$dir/bin/criu" 2>/dev/null || true
  while read -r lib; do
    [[ -n "$lib" ]] || continue
    is_base_lib "$lib" && continue
    cp -L "$lib" "$dir/lib/$(basename "$lib")"
    strip --strip-unneeded "$dir/lib/$(basename "$lib")" 2>/dev/null || true
  done < <(ldd "$bin" | awk '/=> \// {print $3}')
  cat >"$dir/criu" <<'EOF'
#!/bin/sh
# CRIU with the shared libraries it was built against (made by spswap's scripts/build_criu.sh).
here="$(dirname "$(readlink -f "$0")")"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/criu" "$@"
EOF
  chmod 0755 "$dir/criu"
  if [[ -f "$(stamp_file)" && "$bin" == "$PREFIX/sbin/criu" ]]; then  # the patches it has
    install -D -m 0644 "$(stamp_file)" "$dir/share/spswap/criu-patches"
  fi
  log "bundle in $dir ($(du -sh "$dir" | cut -f1)): run $dir/criu"
}

main() {
  local criu
  if [[ $FORCE -eq 0 ]] && criu="$(find_good_criu)"; then
    log "CRIU is already good: $criu"
  else
    [[ $EUID -eq 0 ]] || die "building and installing CRIU needs root (apt-get, $PREFIX/sbin)"
    mkdir -p "$BUILD_DIR"
    install_build_packages
    fetch_tarball
    build
    criu="$PREFIX/sbin/criu"
    is_good "$criu" || die "the built $criu does not report version >= $MIN_MAJOR.$MIN_MINOR"
  fi
  [[ -n "$BUNDLE_DIR" ]] && make_bundle "$criu" "$BUNDLE_DIR"
  "$criu" --version
}

main

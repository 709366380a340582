#!/usr/bin/env bash
# Makes a Debian generic kernel (vmlinuz + modules) available for the VM and
# prints its location as shell assignments:
#   KROOT=<extracted package root> KVER=<uname -r> VMLINUZ=<path> MBASE=<dir holding lib/modules>
#
# usage: fetch-kernel.sh 6.1|6.12|7.3
#
# The packages are downloaded with apt-get download and unpacked with
# dpkg-deb -x into $KERNEL_CACHE/k-<kver>; nothing is installed into the
# host's /boot or /lib/modules. A kernel already in the cache is used without
# touching the network. Each suite gets a private apt state under the cache
# (apt-<suite>/), so the machine's own sources and package lists stay as they
# are; the mirror is the one this machine's apt already uses.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
NAME=${1:?usage: fetch-kernel.sh 6.1|6.12|7.3}
SUITE=$(suite_of "$NAME")
mkdir -p "$KERNEL_CACHE/debs"

# modules live in lib/modules (bookworm) or usr/lib/modules (trixie and later).
report() {
  local kroot=$1 kver=$2 mbase=$1
  [ -d "$kroot/usr/lib/modules/$kver" ] && mbase=$kroot/usr
  # The .debs ship no modules.dep; the guest's module list is resolved from it.
  [ -f "$mbase/lib/modules/$kver/modules.dep" ] || depmod -b "$mbase" "$kver"
  local vmlinuz=
  for f in "$kroot"/boot/vmlinuz-* "$mbase/lib/modules/$kver/vmlinuz"; do
    [ -f "$f" ] && { vmlinuz=$f; break; }
  done
  [ -n "$vmlinuz" ] || die "no vmlinuz in $kroot"
  echo "KROOT=$kroot"
  echo "KVER=$kver"
  echo "VMLINUZ=$vmlinuz"
  echo "MBASE=$mbase"
}

# Cache hit: k-<NAME>.<patch>... (the literal dot keeps 6.1 from matching 6.12).
for d in "$KERNEL_CACHE"/k-"$NAME".*-amd64; do
  [ -d "$d" ] || continue
  report "$d" "${d##*/k-}"
  exit 0
done

"$(dirname "$0")/setup-host.sh"
A=$KERNEL_CACHE/apt-$SUITE
mkdir -p "$A/lists/partial" "$A/cache/archives/partial"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
# Reuse the mirrors this machine's apt is configured with (one-line or deb822).
uri() { grep -rhoE "https?://[^ ]+/$1/?( |$)" /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | head -1 | tr -d ' ' || true; }
MIRROR=$(uri debian); MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=$(uri debian-security); SECURITY=${SECURITY:-http://deb.debian.org/debian-security}
BASE=${SUITE%-backports}
{
  echo "deb [signed-by=$KEYRING] $MIRROR $BASE main"
  echo "deb [signed-by=$KEYRING] $MIRROR $BASE-updates main"
  echo "deb [signed-by=$KEYRING] $SECURITY $BASE-security main"
  [ "$SUITE" = "$BASE" ] || echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main"
} >"$A/sources.list"
APTO=(-o "Dir::Etc::sourcelist=$A/sources.list" -o Dir::Etc::sourceparts=/nonexistent
      -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache")
log "fetch-kernel: apt-get update ($SUITE)"
apt-get "${APTO[@]}" update -qq >&2
REL=()
[ "$SUITE" = "$BASE" ] || REL=(-t "$SUITE")
# The meta package linux-image-amd64 depends on linux-image-<kver>.
IMG=$(apt-cache "${APTO[@]}" "${REL[@]}" depends linux-image-amd64 2>/dev/null \
      | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-amd64\).*/\1/p' | head -1)
[ -n "$IMG" ] || die "cannot resolve linux-image-amd64 in $SUITE"
KVER=${IMG#linux-image-}
case "$KVER" in
  "$NAME".*) ;;
  *) die "$SUITE now ships kernel $KVER, not $NAME.x: update suite_of in integration/lib.sh" ;;
esac
PKGS=("$IMG")
# From 7.x the image is split: linux-binary (vmlinuz), linux-modules, linux-base (config).
if apt-cache "${APTO[@]}" show "linux-binary-$KVER" >/dev/null 2>&1; then
  PKGS=("linux-binary-$KVER" "linux-modules-$KVER" "linux-base-$KVER")
fi
log "fetch-kernel: apt-get download ${PKGS[*]}"
(cd "$KERNEL_CACHE/debs" && apt-get "${APTO[@]}" download "${PKGS[@]}" >&2)
KROOT=$KERNEL_CACHE/k-$KVER
# Extract into a temporary name first so an interrupted run leaves no half kernel.
rm -rf "$KROOT.partial"
mkdir -p "$KROOT.partial"
for p in "${PKGS[@]}"; do dpkg-deb -x "$KERNEL_CACHE/debs/${p}"_*.deb "$KROOT.partial"; done
mv "$KROOT.partial" "$KROOT"
report "$KROOT" "$KVER"

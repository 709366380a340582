#!/usr/bin/env bash
# Builds the kernel's tls module for the 6.1 VM kernel from Debian's own
# source, twice: as Debian ships it (stock) and with a patch applied, for
# vm.sh's VM_TLS_KO. Building both the same way makes a side-by-side run
# differ in the patch alone.
#
# usage: build-tls-ko.sh [PATCH]   (default docs/kernel/tls-splice-read-records.patch)
# prints: TLS_KO_STOCK=<path> and TLS_KO_PATCHED=<path>
#
# Only 6.1: Debian builds bookworm's kernel with this host's compiler (gcc
# 12), and bookworm's kbuild tools run on this host; later kernels are built
# with newer compilers than the host has. The exact source, headers and
# kbuild of the cached kernel's Debian version are downloaded into the
# kernel cache (nothing is installed) and the module is built out of tree
# against the headers, so it loads into the VM's kernel unsigned (the guest
# logs a taint) with the same vermagic and symbol versions as Debian's own.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
PATCH=$(realpath "${1:-$REPO/docs/kernel/tls-splice-read-records.patch}")
eval "$("$(dirname "$0")/fetch-kernel.sh" 6.1)"
deb=$(ls "$KERNEL_CACHE"/debs/linux-image-"$KVER"_*.deb | head -1)
VERSION=$(dpkg-deb -f "$deb" Version)
W=$KERNEL_CACHE/tls-ko-$KVER
mkdir -p "$W/debs"

A=$KERNEL_CACHE/apt-bookworm
APTO=()
[ -f "$A/sources.list" ] && APTO=(-o "Dir::Etc::sourcelist=$A/sources.list" -o Dir::Etc::sourceparts=/nonexistent
  -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache")
PKGS=("linux-headers-$KVER=$VERSION" "linux-headers-${KVER%-amd64}-common=$VERSION"
      "linux-kbuild-6.1=$VERSION" "linux-source-6.1=$VERSION")
if [ ! -f "$W/root/.done" ]; then
  log "build-tls-ko: apt-get download ${PKGS[*]}"
  (cd "$W/debs" && apt-get "${APTO[@]}" download "${PKGS[@]}" >&2)
  rm -rf "$W/root"
  for d in "$W"/debs/*.deb; do dpkg-deb -x "$d" "$W/root"; done
  tar -xJf "$W/root/usr/src/linux-source-6.1.tar.xz" -C "$W/root/usr/src" linux-source-6.1/net/tls
  touch "$W/root/.done"
fi

# The arch headers' Makefile includes the common one by its installed path;
# building from the common tree with O= the arch tree needs neither.
H=$W/root/usr/src
build() { # NAME [PATCH]
  local dir=$W/$1
  rm -rf "$dir"
  cp -r "$H/linux-source-6.1/net/tls" "$dir"
  [ -z "${2:-}" ] || patch -d "$dir" -p3 --quiet <"$2"
  make -s -C "$H/linux-headers-${KVER%-amd64}-common" O="$H/linux-headers-$KVER" M="$dir" CONFIG_TLS=m modules >&2
  strip --strip-debug -o "$W/tls-$1.ko" "$dir/tls.ko"
}
build stock
build patched "$PATCH"
echo "TLS_KO_STOCK=$W/tls-stock.ko"
echo "TLS_KO_PATCHED=$W/tls-patched.ko"

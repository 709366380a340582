#!/usr/bin/env bash
# Builds a VM kernel's tls module from Debian's own source, twice: as Debian
# ships the source (stock) and with a patch applied (patched), for vm.sh's
# VM_TLS_KO. Both are built the same way, so a side-by-side run of the two
# differs in the patch alone; compare them with each other, not with the
# kernel's own module (another compiler and build).
#
# usage: build-tls-ko.sh 6.1|7.3 [PATCH]
#        (default PATCH: docs/kernel/tls-splice-read-records-KERNEL.patch)
# prints: TLS_KO_STOCK=<path>, TLS_KO_PATCHED=<path> and, for 7.3,
#         TLS_SELFTEST=<path>
#
# TLS_SELFTEST is the kernel's own TLS selftest (tools/testing/selftests/
# net/tls.c of the same source, with the patch's hunks for it), built in
# the build dir so that the guest sees it: `VM_TLS_KO=... vm.sh 7.3
# "$TLS_SELFTEST"` runs it against either module. Not for 6.1: the tls.c
# of Debian's 6.1.192 does not compile (a backported test calls
# tls_crypto_info_init with an argument that version lacks).
#
# The source, headers and kbuild of the cached kernel's exact Debian version
# are downloaded into the kernel cache (nothing is installed), and the
# module is built out of tree against the headers: same vermagic (and, on
# 6.1, symbol versions) as Debian's, unsigned (the guest logs a taint).
#   6.1  Debian builds it with this host's gcc 12, and bookworm's kbuild
#        tools run here: a plain out-of-tree build.
#   7.3  Built with gcc 14, whose -fmin-function-alignment gcc 12 lacks (the
#        copy of the headers here drops it for -falign-functions), and
#        trixie's modpost and objtool need a newer glibc: modpost is built
#        from the same source, and objtool, which only annotates the object
#        (return thunks, ORC unwind tables; under TCG nothing needs them), is
#        left out, as is BTF (no pahole). So the two modules cost a little
#        more per call than Debian's: another reason to compare only them.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
NAME=${1:?usage: build-tls-ko.sh 6.1|7.3 [PATCH]}
case $NAME in
  6.1 | 7.3) ;;
  *) die "build-tls-ko.sh: kernel $NAME: only 6.1 and 7.3" ;;
esac
PATCH=$(realpath "${2:-$REPO/docs/kernel/tls-splice-read-records-$NAME.patch}")
eval "$("$(dirname "$0")/fetch-kernel.sh" "$NAME")"
SUITE=$(suite_of "$NAME")
deb=
for f in "$KERNEL_CACHE"/debs/linux-{image,modules}-"$KVER"_*.deb; do
  [ -f "$f" ] && { deb=$f; break; }
done
[ -n "$deb" ] || die "no package of kernel $KVER in $KERNEL_CACHE/debs"
VERSION=$(dpkg-deb -f "$deb" Version)
W=$KERNEL_CACHE/tls-ko-$KVER
mkdir -p "$W/debs"

A=$KERNEL_CACHE/apt-$SUITE
APTO=()
[ -f "$A/sources.list" ] && APTO=(-o "Dir::Etc::sourcelist=$A/sources.list" -o Dir::Etc::sourceparts=/nonexistent
  -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache")
COMMON=linux-headers-${KVER%-amd64}-common
KBUILD=linux-kbuild-$NAME
[ "$NAME" = 6.1 ] || KBUILD=linux-kbuild-${KVER%-amd64}
H=$W/root/usr/src
if [ ! -f "$W/root/.done" ]; then
  log "build-tls-ko: apt-get download the $VERSION source, headers and kbuild"
  (cd "$W/debs" && apt-get "${APTO[@]}" download "linux-headers-$KVER=$VERSION" "$COMMON=$VERSION" \
    "$KBUILD=$VERSION" "linux-source-$NAME=$VERSION" >&2)
  rm -rf "$W/root"
  for d in "$W"/debs/*.deb; do dpkg-deb -x "$d" "$W/root"; done
  parts=(net/tls tools/testing/selftests/kselftest_harness.h tools/testing/selftests/kselftest.h
    tools/testing/selftests/net/tls.c)
  [ "$NAME" = 6.1 ] || parts+=(scripts/mod scripts/include include)
  tar -xJf "$H/linux-source-$NAME.tar.xz" -C "$H" "${parts[@]/#/linux-source-$NAME/}"
  if [ "$NAME" != 6.1 ]; then
    sed -i '/^CONFIG_CC_HAS_MIN_FUNCTION_ALIGNMENT=/d' "$H/linux-headers-$KVER/include/config/auto.conf"
    # modpost from its source, as scripts/mod/Makefile builds it.
    m=$H/linux-source-$NAME/scripts/mod
    gcc -c -o "$m/empty.o" "$m/empty.c"
    gcc -o "$m/mk_elfconfig" "$m/mk_elfconfig.c"
    "$m/mk_elfconfig" <"$m/empty.o" >"$m/elfconfig.h"
    inc=()
    for d in "$H/$COMMON" "$H/linux-headers-$KVER"; do
      inc+=(-I"$d/include" -I"$d/arch/x86/include" -I"$d/arch/x86/include/generated" -I"$d/arch/x86/include/uapi"
        -I"$d/arch/x86/include/generated/uapi" -I"$d/include/uapi" -I"$d/include/generated/uapi")
    done
    gcc -S -o "$m/devicetable-offsets.s" "$m/devicetable-offsets.c" -D__KERNEL__ -nostdinc "${inc[@]}" \
      -include "$H/$COMMON/include/linux/compiler-version.h" -include "$H/$COMMON/include/linux/kconfig.h" \
      -include "$H/$COMMON/include/linux/compiler_types.h"
    { echo "#ifndef __DEVICETABLE_OFFSETS_H__"; echo "#define __DEVICETABLE_OFFSETS_H__"
      sed -ne 's:^[[:space:]]*\.ascii[[:space:]]*"\(.*\)".*:\1:; /^->/{s:->#\(.*\):/* \1 */:; s:^->\([^ ]*\) [\$#]*\([^ ]*\) \(.*\):#define \1 \2 /* \3 */:; s:->::; p;}' \
        <"$m/devicetable-offsets.s"
      echo "#endif"; } >"$m/devicetable-offsets.h"
    gcc -O2 -o "$W/root/usr/lib/$KBUILD/scripts/mod/modpost" "$m"/{modpost,file2alias,sumversion,symsearch}.c \
      -I"$m" -I"$m/../include" -I"$m/../../include/uapi"
  fi
  touch "$W/root/.done"
fi

# The arch headers' Makefile includes the common one by its installed path;
# building from the common tree with O= the arch tree needs neither.
MAKEFLAGS_KO=(CONFIG_TLS=m)
[ "$NAME" = 6.1 ] || MAKEFLAGS_KO+=(CC=gcc CROSS_COMPILE= objtool=/bin/true CONFIG_DEBUG_INFO_BTF_MODULES=)
# The source tree's parts, patched or not, in $W/VARIANT.
tree() { # VARIANT [PATCH]
  local t=$W/$1
  rm -rf "$t"
  mkdir -p "$t"
  (cd "$H/linux-source-$NAME" && cp -r --parents net/tls tools "$t")
  [ -z "${2:-}" ] || patch -d "$t" -p1 --quiet <"$2"
}
build() { # VARIANT
  make -s -C "$H/$COMMON" O="$H/linux-headers-$KVER" KBUILD_OUTPUT="$H/linux-headers-$KVER" M="$W/$1/net/tls" \
    "${MAKEFLAGS_KO[@]}" modules >&2
  strip --strip-debug -o "$W/tls-$1.ko" "$W/$1/net/tls/tls.ko"
}
tree stock
tree patched "$PATCH"
build stock
build patched
echo "TLS_KO_STOCK=$W/tls-stock.ko"
echo "TLS_KO_PATCHED=$W/tls-patched.ko"
[ "$NAME" != 6.1 ] || exit 0
# The selftest wants this kernel's <linux/tls.h> (newer than the host's);
# the rest of its headers are the host's.
mkdir -p "$W/selftest-include/linux"
cp "$H/$COMMON/include/uapi/linux/tls.h" "$W/selftest-include/linux/"
SELFTEST=$BUILD/kernel/tls-selftest-$KVER
mkdir -p "$(dirname "$SELFTEST")"
gcc -O2 -o "$SELFTEST" -I"$W/patched/tools/testing/selftests" -I"$W/selftest-include" \
  "$W/patched/tools/testing/selftests/net/tls.c" -lpthread
echo "TLS_SELFTEST=$SELFTEST"

#!/usr/bin/env bash
# Boots a Debian generic kernel under qemu (TCG: no KVM needed) and runs one
# shell command on it, inside a chroot of this machine's own root file
# system, so host-built binaries (Go test binaries, bin/caddy, curl, openssl)
# run unchanged on a kernel that has kTLS.
#
# usage: vm.sh 6.1|6.12|7.3 'command'
#
# The guest sees:
#   /                 the host's root, read-only over virtio-9p
#   the checkout      at its host path, read-only (its own 9p share, so a
#                     checkout under /tmp or /root is visible too)
#   /tmp /run /root   fresh tmpfs (t.TempDir() works)
#   /run/vm-out       $VM_OUT on the host, read-write: results come back here
#   network           loopback only, which also holds 192.0.2.1/32: an
#                     address of the guest's own that is not loopback
# The command runs with the checkout as working directory and a clean
# environment (HOME, PATH, VM_OUT); pass variables in the command itself.
#
# env:
#   VM_OUT           host results dir (default: a fresh dir under the build dir)
#   VM_TIMEOUT       seconds for the whole run, boot included (default 900)
#   VM_BOOT_TIMEOUT  seconds for the guest to reach its init (default 180; a loaded 2-core host can take a minute)
#   VM_BOOT_RETRIES  boots that never reach init are retried (default 2): the
#                    7.x kernels sometimes oops in early boot under TCG
#   VM_SMP, VM_MEM   vCPUs (default 1: SMP=2 makes that oops likelier) and MiB (default 2048)
#   VM_LOG           serial log file (default $VM_OUT/serial.log)
#   VM_TLS_KO        a tls.ko built for this kernel, loaded in its own's
#                    place: to measure a change to kTLS (build-tls-ko.sh)
#   VM_ICOUNT=1      deterministic guest time for cost measurements: one
#                    vCPU, single-threaded TCG and `-icount shift=0,sleep=off`,
#                    so guest time counts executed instructions (1 ns each)
#                    and does not depend on host load (see docs/bench)
# exit: the command's exit status; 1 if the guest did not report one (boot
# failure, panic, timeout).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
NAME=${1:?usage: vm.sh KERNEL 'command'}
CMD=${2:?usage: vm.sh KERNEL 'command'}
VM_OUT=${VM_OUT:-$(mkdir -p "$BUILD" && mktemp -d "$BUILD/vm-out.XXXXXX")}
VM_LOG=${VM_LOG:-$VM_OUT/serial.log}
mkdir -p "$VM_OUT"
VM_OUT=$(cd "$VM_OUT" && pwd)
rm -f "$VM_OUT/.exit"

"$(dirname "$0")/setup-host.sh"
eval "$("$(dirname "$0")/fetch-kernel.sh" "$NAME")"

# The initramfs: static busybox, the kernel's modules for 9p, tls and the
# AEADs, the init script and the command. Modules are listed in dependency
# order by modprobe --show-depends against the extracted tree; compressed
# ones are unpacked here because busybox insmod reads plain .ko files.
# Names a kernel does not have (they moved between 6.1 and 7.3) are skipped.
# The crypto must be loaded up front: setsockopt(TLS_TX) looks the AEAD up by
# name and the guest has no modprobe helper for this kernel, so a missing
# module surfaces as ENOENT from setsockopt, not at insmod.
W=$(mktemp -d "${TMPDIR:-/tmp}/ktls-vm.XXXXXX")
QPID=
cleanup() {
  [ -n "$QPID" ] && kill "$QPID" 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
R=$W/root
mkdir -p "$R/bin" "$R/mods" "$R/proc" "$R/sys" "$R/dev" "$R/host"
cp /bin/busybox "$R/bin/busybox"
# inet_diag/tcp_diag serve sock_diag queries (ss, the ULP diagnostics);
# ccm, the kernel TLS selftest's AES-CCM cases (docs/kernel); sch_prio,
# sch_netem and cls_u32, the delay bench ttfb puts on one loopback address
# (its tc fails, naming them, where one is missing).
MODULES="virtio_pci 9pnet_virtio 9p tls gcm ctr ccm ghash_generic ghash_clmulni_intel aesni_intel
  chacha20poly1305 chacha_x86_64 poly1305_x86_64 libchacha chacha chacha_generic libpoly1305 poly1305_generic
  inet_diag tcp_diag sch_prio sch_netem cls_u32"
for m in $MODULES; do
  { modprobe -d "$MBASE" -S "$KVER" --show-depends "$m" 2>/dev/null || true; } | awk '$1 == "insmod" { print $2 }'
done | awk '!seen[$0]++' | while read -r ko; do
  n=$(basename "$ko"); n=${n%.xz}; n=${n%.zst}
  case "$ko" in
    *.xz) xz -dc "$ko" >"$R/mods/$n" ;;
    *.zst) zstd -qdc "$ko" >"$R/mods/$n" ;;
    *) cp "$ko" "$R/mods/$n" ;;
  esac
  echo "$n"
done >"$R/order"
if [ -n "${VM_TLS_KO:-}" ]; then
  grep -qx tls.ko "$R/order" || die "VM_TLS_KO: kernel $KVER loads no tls.ko to replace"
  cp "$VM_TLS_KO" "$R/mods/tls.ko"
  log "vm: tls.ko replaced by $VM_TLS_KO"
fi
printf '%s\n' "$CMD" >"$R/cmd"
printf "%s\n" "$REPO" >"$R/checkout-path"
cat >"$R/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
boot=$(cut -d' ' -f1 /proc/uptime)
echo "VM: init start, uptime ${boot}s, kernel $(uname -r)"
for m in $(cat /order); do insmod "/mods/$m" || echo "VM: insmod $m failed"; done
ip link set lo up
# The guest has no NIC (-nic none). An address of its own besides loopback
# lets the tests of the forwarder's refusal of the host's own addresses run
# (forwardtest.HostAddress fails without one under KTLS_REQUIRE=1).
ip addr add 192.0.2.1/32 dev lo
fail() { echo "VM: $*"; sync; poweroff -f; }
repo=$(cat /checkout-path)
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /host || fail "9p mount of host root failed"
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mount -t tmpfs tmp /host/tmp; mount -t tmpfs run /host/run; mount -t tmpfs home /host/root
mkdir -p "/host$repo" /host/run/vm-out
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose checkout "/host$repo" || fail "9p mount of the checkout failed"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 vmout /host/run/vm-out || fail "9p mount of the results dir failed"
cp /cmd /host/run/vm-cmd
echo "VM: running command"
t0=$(cut -d' ' -f1 /proc/uptime)
chroot /host /usr/bin/env -i HOME=/root VM_OUT=/run/vm-out \
  PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /bin/sh -c "cd \"$repo\" && exec /bin/sh /run/vm-cmd" </dev/null
rc=$?
t1=$(cut -d' ' -f1 /proc/uptime)
echo "$rc $boot $t0 $t1" >/host/run/vm-out/.exit
echo "VM: command exit $rc"
sync
poweroff -f
INIT
chmod +x "$R/init"
(cd "$R" && find . | cpio -o -H newc --quiet) >"$W/initrd"

# One boot attempt. Streams the serial console to stdout (escape codes from
# SeaBIOS stripped) and enforces both timeouts. Returns 0 when the guest
# reached its init, 2 when it did not (worth a retry), 1 on timeout.
boot() {
  : >"$VM_LOG"
  # clocksource=tsc tsc=reliable: under TCG the guest otherwise falls back to
  # HPET, and every clock read (Go's scheduler, timers) gets ~10x slower.
  # panic=-1 with -no-reboot turns a guest panic into a qemu exit.
  # no_timer_check: the kernel's early IO-APIC timer check measures ticks in
  # wall-clock time; when the host is busy, the emulated CPU falls behind and
  # the check panics ("IO-APIC + timer doesn't work!").
  qemu-system-x86_64 -nographic -no-reboot -nodefaults -serial stdio -nic none \
    "${ACCEL[@]}" -cpu max -m "${VM_MEM:-2048}" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$REPO,mount_tag=checkout,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$VM_OUT,mount_tag=vmout,security_model=none" \
    -kernel "$VMLINUZ" -initrd "$W/initrd" \
    -append "console=ttyS0 quiet panic=-1 clocksource=tsc tsc=reliable no_timer_check" \
    </dev/null >"$VM_LOG" 2>&1 &
  QPID=$!
  tail --pid="$QPID" -n +1 -f "$VM_LOG" | sed -u 's/\x1b//g' &
  local tailpid=$! start booted=0 status=0
  start=$(now)
  while kill -0 "$QPID" 2>/dev/null; do
    if [ $booted -eq 0 ] && grep -q 'VM: init start' "$VM_LOG"; then booted=1; fi
    if [ $booted -eq 0 ] && [ "$(elapsed "$start" | cut -d. -f1)" -ge "${VM_BOOT_TIMEOUT:-180}" ]; then
      log "VM-HOST: guest did not reach init in ${VM_BOOT_TIMEOUT:-180}s: killing qemu"
      kill "$QPID"; status=2; break
    fi
    if [ "$(elapsed "$START" | cut -d. -f1)" -ge "${VM_TIMEOUT:-900}" ]; then
      log "VM-HOST: run exceeded VM_TIMEOUT=${VM_TIMEOUT:-900}s: killing qemu"
      kill "$QPID"; status=1; break
    fi
    sleep 0.5
  done
  wait "$QPID" 2>/dev/null || true
  QPID=
  wait "$tailpid" 2>/dev/null || true
  grep -q 'VM: init start' "$VM_LOG" && booted=1
  if [ $status -eq 0 ] && [ $booted -eq 0 ]; then status=2; fi
  return $status
}

if [ "${VM_ICOUNT:-0}" = 1 ]; then
  ACCEL=(-accel tcg,thread=single -icount shift=0,sleep=off -smp 1)
else
  ACCEL=(-accel tcg,thread=multi -smp "${VM_SMP:-1}")
fi
START=$(now)
tries=$(( ${VM_BOOT_RETRIES:-2} + 1 ))
for try in $(seq 1 "$tries"); do
  rc=0
  boot || rc=$?
  [ $rc -eq 2 ] || break
  log "VM-HOST: kernel $KVER: boot attempt $try never reached init"
  [ "$try" -lt "$tries" ] && cp "$VM_LOG" "$VM_LOG.failed-boot-$try"
done
WALL=$(elapsed "$START")
if [ ! -s "$VM_OUT/.exit" ]; then
  log "VM-HOST: kernel $KVER: FAIL: the guest reported no result (see $VM_LOG), wall ${WALL}s"
  exit 1
fi
read -r GUEST_RC BOOT T0 T1 <"$VM_OUT/.exit"
CMD_S=$(awk -v a="$T0" -v b="$T1" 'BEGIN { printf "%.1f", b - a }')
log "VM-HOST: kernel $KVER: boot ${BOOT}s (guest uptime at init), command ${CMD_S}s, wall ${WALL}s, exit $GUEST_RC"
printf 'kernel=%s boot=%s command=%s wall=%s exit=%s\n' "$KVER" "$BOOT" "$CMD_S" "$WALL" "$GUEST_RC" >"$VM_OUT/times"
exit "$GUEST_RC"

#!/usr/bin/env bash
# The benchmark harness (docs/bench): builds Caddy with this module and the
# driver (integration/bench), then runs every contender against the same
# upstream and writes one JSON document.
#
# usage: integration/bench.sh [--smoke|--native] [driver flags...]
#
#   (default)  in a VM on kernel $BENCH_KERNEL under qemu -icount (guest time
#              counts instructions: deterministic, blind to host load) at the
#              full size; writes docs/bench/results.json
#   --smoke    the same at a tiny size, every contender once; fails if any
#              contender did not move the exact bytes (SHA-256 both ways) or
#              ran on the wrong data path; writes $BUILD/bench/smoke/results.json
#   --native   on this host's own kernel, wall-clock figures; contenders that
#              need kTLS are refused when the kernel has none. The strace pass
#              needs root (or kernel.yama.ptrace_scope=0); pass -no-structural
#              otherwise. Writes $BUILD/bench/native/results.json
#
# Driver flags (integration/.build/bench/bench run -h) override the sizes,
# e.g. -contenders ktls,floor-ktls -shapes upload.
# env: BENCH_KERNEL (default 7.3), BENCH_BULK_MIB (64), BENCH_REPS (3),
#      BENCH_OUT (the JSON's destination), CADDY (a prebuilt Caddy binary
#      inside the checkout instead of building one), VM_TIMEOUT
#      (default 14400 s for the full run, 1800 s for the smoke run).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
MODE=full
case "${1:-}" in
  --smoke) MODE=smoke; shift ;;
  --native) MODE=native; shift ;;
esac
cd "$REPO"
OUT=$BUILD/bench
mkdir -p "$OUT"
# Caddy is built for this run alone, not into bin/: a `make build` while the
# VM runs would swap the binary under the guest (9p shares it live).
if [ -z "${CADDY:-}" ]; then
  CADDY=${OUT#"$REPO"/}/caddy
  go build -o "$CADDY" ./cmd/caddy
fi
go build -o "$OUT/bench" ./integration/bench

case $MODE in
  smoke)
    SIZES=(-bulk-bytes $((1 << 20)) -reps 1 -small-conns 4 -small-calls 40 -small-per-call-calls 8
      -structural-bytes $((256 << 10)) -structural-calls 20)
    DEST=${BENCH_OUT:-$OUT/smoke/results.json} ;;
  *)
    SIZES=(-bulk-bytes $((${BENCH_BULK_MIB:-64} << 20)) -reps "${BENCH_REPS:-3}")
    if [ $MODE = full ]; then DEST=${BENCH_OUT:-docs/bench/results.json}; else DEST=${BENCH_OUT:-$OUT/native/results.json}; fi ;;
esac
mkdir -p "$(dirname "$DEST")"
start=$(now)
if [ $MODE = native ]; then
  "$(dirname "$0")/setup-host.sh"
  rc=0
  "$OUT/bench" run -mode native -caddy "$CADDY" -out "$DEST" "${SIZES[@]}" "$@" || rc=$?
else
  VM_OUT=$OUT/vm-out-$MODE
  rm -rf "$VM_OUT"
  mkdir -p "$VM_OUT"
  [ $MODE = smoke ] && timeout=1800 || timeout=14400
  # The command line is one string the guest's sh runs: quote every word.
  cmd=$(printf '%q ' "$OUT/bench" run -mode vm-icount -caddy "$CADDY" -out /run/vm-out/results.json "${SIZES[@]}" "$@")
  rc=0
  VM_ICOUNT=1 VM_OUT=$VM_OUT VM_TIMEOUT=${VM_TIMEOUT:-$timeout} \
    "$(dirname "$0")/vm.sh" "${BENCH_KERNEL:-7.3}" "$cmd" || rc=$?
  # The JSON comes back even from a failing run: its errors say what failed.
  if [ -f "$VM_OUT/results.json" ]; then cp "$VM_OUT/results.json" "$DEST"; else DEST="none (the guest wrote no results.json)"; fi
fi
log "bench ($MODE): exit $rc, wall $(elapsed "$start")s, results in $DEST"
exit $rc

#!/usr/bin/env bash
# The benchmark harness (docs/bench): builds Caddy with this module and the
# driver (integration/bench), then runs every contender against the same
# upstream and writes one JSON document.
#
# usage: integration/bench.sh [--native] [--smoke] [--load | --ttfb] [driver flags...]
#        BENCH_SPLIT='A,B C,D' integration/bench.sh ... (see env)
#
#   (default)  in a VM on kernel $BENCH_KERNEL under qemu -icount (guest time
#              counts instructions: deterministic, blind to host load) at the
#              full size; writes docs/bench/results.json (make bench: split
#              in two, results-1.json, results-2.json and results.md)
#   --smoke    at a tiny size, every contender once; fails if any
#              contender did not move the exact bytes (SHA-256 both ways) or
#              ran on the wrong data path; writes $BUILD/bench/smoke/results.json
#   --load     the open-loop load run instead (bench load; docs/bench/load.md):
#              a real-time VM (no icount) on kernel $BENCH_LOAD_KERNEL with
#              two vCPUs, the contender pinned to vCPU 0 and the generator
#              to vCPU 1; writes docs/bench/load.json and renders load.md
#              (with --smoke: 4 and 8 calls/s, 2 s each, 50 tunnels, 20 targets, ktls,
#              haproxy and the l4-l4 gateway chain, strict: any failed call fails; writes
#              $BUILD/bench/load-smoke/load.json); -contenders names the
#              gateway chains too (l7-l7, l7-l4, l4-l4, l4-l4-standby: every
#              process of a chain on vCPU 0)
#   --ttfb     a new connection's time to first byte through the gateway
#              chains instead (bench ttfb; docs/bench/ttfb.md): l7-l7,
#              l4-l4 and l4-l4 with standby connections, netem delaying
#              the gateway↔forwarder path at 1, 20 and 100 ms RTT; the same
#              real-time VM as --load (kernel $BENCH_TTFB_KERNEL, the chain's
#              processes on vCPU 0, the client on vCPU 1); writes
#              docs/bench/ttfb.json and renders ttfb.md (with --smoke: 3
#              connections per contender at 1 and 20 ms, the path check's
#              tolerance widened by 5 ms; writes
#              $BUILD/bench/ttfb-smoke/ttfb.json)
#   --native   on this host's own kernel, wall-clock figures; contenders that
#              need kTLS are refused (REFUSED, in the log and the JSON's
#              "skipped") when the kernel has none. The strace pass needs root
#              (or kernel.yama.ptrace_scope=0); pass -no-structural otherwise.
#              Writes $BUILD/bench/native/results.json, with --smoke
#              $BUILD/bench/native-smoke/results.json
#
# Driver flags (integration/.build/bench/bench run -h; load -h, ttfb -h) override the sizes,
# e.g. -contenders ktls,floor-ktls -shapes upload; -gateway-ktls makes the
# gateway seal its records in its kernel. A kTLS change is measured with
# VM_TLS_KO (vm.sh; docs/kernel).
# env: BENCH_KERNEL (default 7.3), BENCH_LOAD_KERNEL (default 6.1: two
#      vCPUs make 7.x's early-boot oops likelier), BENCH_TTFB_KERNEL
#      (default 6.1, for the same reason), BENCH_LOAD_LABEL (the
#      load report's label, e.g. a reduced run's), BENCH_BULK_MIB (64), BENCH_REPS (3),
#      BENCH_OUT (the JSON's destination), CADDY (a prebuilt Caddy binary
#      inside the checkout instead of building one), VM_TIMEOUT
#      (default 14400 s for the full run, 1800 s for the smoke run),
#      BENCH_SPLIT (VM modes): groups of contenders separated by spaces,
#      e.g. "ktls,floor-ktls l4-proxy,nginx": one VM per group, side by side
#      (one host core each; under icount a guest's figures do not depend on
#      the host's load), each writing ${BENCH_OUT%.json}-N.json for group N;
#      their merged report goes to ${BENCH_OUT%.json}.md and .png.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
# -h/--help anywhere: this header and the driver's flags, on this host,
# before anything is installed, built into the VM or booted.
for a in "$@"; do
  case $a in
    -h | -help | --help)
      sed -n '2,/^set -euo pipefail$/{/^set /d;s/^# \{0,1\}//;p}' "$0"
      echo
      echo "The driver's flags:"
      cd "$REPO" && go run ./integration/bench run -h 2>&1 | sed 1d
      exit 0 ;;
  esac
done
WHERE=vm SIZE=full KIND=run
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SIZE=smoke; shift ;;
    --load) KIND=load; shift ;;
    --ttfb) KIND=ttfb; shift ;;
    --native) WHERE=native; shift ;;
    *) break ;;
  esac
done
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
# The commit measured, recorded in the JSON: a report is stale once the
# code it measures changed after it (integration/benchreport's tests).
COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- . ':(exclude)docs' 2>/dev/null || COMMIT+=-dirty

if [ $KIND = load ]; then
  # The load run: one real-time VM with two vCPUs (multi-threaded TCG),
  # the contender on vCPU 0, the generator on vCPU 1.
  if [ $SIZE = smoke ]; then
    # The generator's deadline 15 s, not 5: under TCG on a busy host a
    # per-call through l4-l4 (a handshake at the gateway and one to the
    # forwarder) takes up to 2 s at 8 calls/s, and strict fails on any
    # timeout.
    SIZES=(-contenders ktls,haproxy,l4-l4 -tunnels 50 -targets 20 -rates 4,8 -step 2 -bulk 2 -bulk-bytes $((256 << 10)) -call-timeout 15s -strict)
    DEST=${BENCH_OUT:-$OUT/load-smoke/load.json} timeout=600
  else
    SIZES=(-tunnels 10000 -targets 1000 -bulk 8 -unloaded-rate 2 -unloaded-step 30 -step 10)
    DEST=${BENCH_OUT:-docs/bench/load.json} timeout=7200
  fi
  [ $WHERE = native ] && die "bench: --load runs in a VM (its setup is what load.md describes)"
  mkdir -p "$(dirname "$DEST")"
  start=$(now)
  vm_out=$OUT/vm-out-load-$SIZE
  rm -rf "$vm_out"
  mkdir -p "$vm_out"
  # Room for 10,000 tunnels (two sockets each in the forwarder) and for a
  # connection per call (TIME_WAIT reuse, the port range from 1024), with
  # the ports above 60999 left out of it for the contenders to listen on
  # (internal/freeport picks them outside the range).
  cmd="ulimit -n 1048576 && echo 1 >/proc/sys/net/ipv4/tcp_tw_reuse && echo '1024 60999' >/proc/sys/net/ipv4/ip_local_port_range && "
  cmd+=$(printf '%q ' taskset -c 1 "$OUT/bench" load -mode vm -pin-contender 0 -caddy "$CADDY" -commit "$COMMIT" -label "${BENCH_LOAD_LABEL:-}" -out /run/vm-out/load.json "${SIZES[@]}" "$@")
  rc=0
  VM_SMP=2 VM_MEM=${VM_MEM:-4096} VM_OUT=$vm_out VM_TIMEOUT=${VM_TIMEOUT:-$timeout} \
    "$(dirname "$0")/vm.sh" "${BENCH_LOAD_KERNEL:-6.1}" "$cmd" || rc=$?
  if [ -f "$vm_out/load.json" ]; then
    cp "$vm_out/load.json" "$DEST"
    go run ./integration/benchreport load -in "$DEST" -md "${DEST%.json}.md" || rc=1
  else
    log "bench: the guest wrote no load.json"
    rc=1
  fi
  log "bench load ($SIZE): exit $rc, wall $(elapsed "$start")s, results in $DEST and ${DEST%.json}.md"
  exit $rc
fi

if [ $KIND = ttfb ]; then
  # The same real-time VM as the load run: the chain's two Caddy processes
  # on vCPU 0, the client (and the upstream, in its process) on vCPU 1.
  if [ $SIZE = smoke ]; then
    # The path check's constant widened to 5 ms: on a busy host a TCG
    # connect alone can take milliseconds; 20 ms still has to show.
    SIZES=(-rtts 1ms,20ms -conns 3 -pause 100ms -settle 1s -probes 5 -tolerance-ms 5 -label smoke)
    DEST=${BENCH_OUT:-$OUT/ttfb-smoke/ttfb.json} timeout=900
  else
    SIZES=()
    DEST=${BENCH_OUT:-docs/bench/ttfb.json} timeout=1800
  fi
  [ $WHERE = native ] && die "bench: --ttfb runs in a VM (it puts netem on the loopback device)"
  mkdir -p "$(dirname "$DEST")"
  start=$(now)
  vm_out=$OUT/vm-out-ttfb-$SIZE
  rm -rf "$vm_out"
  mkdir -p "$vm_out"
  cmd=$(printf '%q ' taskset -c 1 "$OUT/bench" ttfb -mode vm -pin-contender 0 -caddy "$CADDY" -commit "$COMMIT" -out /run/vm-out/ttfb.json "${SIZES[@]}" "$@")
  rc=0
  VM_SMP=2 VM_OUT=$vm_out VM_TIMEOUT=${VM_TIMEOUT:-$timeout} \
    "$(dirname "$0")/vm.sh" "${BENCH_TTFB_KERNEL:-6.1}" "$cmd" || rc=$?
  if [ -f "$vm_out/ttfb.json" ]; then
    cp "$vm_out/ttfb.json" "$DEST"
    go run ./integration/benchreport ttfb -in "$DEST" -md "${DEST%.json}.md" || rc=1
  else
    log "bench: the guest wrote no ttfb.json"
    rc=1
  fi
  log "bench ttfb ($SIZE): exit $rc, wall $(elapsed "$start")s, results in $DEST and ${DEST%.json}.md"
  exit $rc
fi

if [ $SIZE = smoke ]; then
  SIZES=(-bulk-bytes $((1 << 20)) -reps 1 -small-conns 4 -small-calls 40 -small-per-call-calls 8
    -structural-bytes $((256 << 10)) -structural-calls 20)
else
  SIZES=(-bulk-bytes $((${BENCH_BULK_MIB:-64} << 20)) -reps "${BENCH_REPS:-3}")
fi
case $WHERE-$SIZE in
  vm-full) DEST=${BENCH_OUT:-docs/bench/results.json} ;;
  vm-smoke) DEST=${BENCH_OUT:-$OUT/smoke/results.json} ;;
  native-full) DEST=${BENCH_OUT:-$OUT/native/results.json} ;;
  native-smoke) DEST=${BENCH_OUT:-$OUT/native-smoke/results.json} ;;
esac
mkdir -p "$(dirname "$DEST")"
start=$(now)
if [ $WHERE = native ]; then
  "$(dirname "$0")/setup-host.sh"
  rc=0
  "$OUT/bench" run -mode native -caddy "$CADDY" -commit "$COMMIT" -out "$DEST" "${SIZES[@]}" "$@" || rc=$?
else
  [ $SIZE = smoke ] && timeout=1800 || timeout=14400
  read -ra groups <<<"${BENCH_SPLIT:-}"
  # Group N's VM writes VM_OUT-N and its JSON to DEST-N; without a split,
  # the one VM writes DEST itself.
  vm_run() { # N [contender flags...]
    local n=$1 vm_out=$OUT/vm-out-$SIZE${1:+-$1} dest=$DEST; shift
    [ -n "$n" ] && dest=${DEST%.json}-$n.json
    rm -rf "$vm_out"
    mkdir -p "$vm_out"
    # The command line is one string the guest's sh runs: quote every word.
    local cmd vrc=0
    cmd=$(printf '%q ' "$OUT/bench" run -mode vm-icount -caddy "$CADDY" -commit "$COMMIT" -out /run/vm-out/results.json "${SIZES[@]}" "$@")
    VM_ICOUNT=1 VM_OUT=$vm_out VM_TIMEOUT=${VM_TIMEOUT:-$timeout} \
      "$(dirname "$0")/vm.sh" "${BENCH_KERNEL:-7.3}" "$cmd" || vrc=$?
    # The JSON comes back even from a failing run: its errors say what failed.
    if [ -f "$vm_out/results.json" ]; then cp "$vm_out/results.json" "$dest"; else log "bench: the guest of ${n:-the run} wrote no results.json"; fi
    return $vrc
  }
  rc=0
  if [ ${#groups[@]} -eq 0 ]; then
    vm_run "" "$@" || rc=$?
  else
    pids=()
    for i in "${!groups[@]}"; do
      vm_run $((i + 1)) "$@" -contenders "${groups[$i]}" > "$OUT/split-$((i + 1)).log" 2>&1 &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do
      grc=0
      wait "${pids[$i]}" || grc=$?
      log "bench: group $((i + 1)) (${groups[$i]}): exit $grc, log $OUT/split-$((i + 1)).log"
      [ $grc -eq 0 ] || rc=$grc
    done
    ins=()
    for i in "${!groups[@]}"; do
      [ -f "${DEST%.json}-$((i + 1)).json" ] && ins+=("${DEST%.json}-$((i + 1)).json")
    done
    if [ ${#ins[@]} -eq ${#groups[@]} ]; then
      go run ./integration/benchreport results -in "$(IFS=,; echo "${ins[*]}")" -md "${DEST%.json}.md" -png "${DEST%.json}.png" || rc=1
      DEST="${ins[*]} (report ${DEST%.json}.md)"
    else
      DEST="${ins[*]:-none} (not every group wrote its JSON)"
      rc=1
    fi
  fi
fi
log "bench ($WHERE, $SIZE): exit $rc, wall $(elapsed "$start")s, results in $DEST"
exit $rc

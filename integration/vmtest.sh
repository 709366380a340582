#!/usr/bin/env bash
# The real-kernel suite: builds every package's test binary on the host and
# runs its TestKernel* tests in a VM on each kernel of the matrix, then checks
# /proc/net/tls_stat to prove that the kernel's software kTLS path ran.
#
# usage: vmtest.sh [KERNEL...]     (default: $KERNELS, or "6.1 7.3")
# env: KTLS_TEST_MIB (bulk transfer size of the kernel tests, default theirs),
#      KTLS_LOAD_TUNNELS, KTLS_LOAD_RELOADS (size of the reload and upgrade tests, default theirs),
#      KTLS_BINARY_DOWNLOAD_MIB (the real-binary test's download, default KTLS_TEST_MIB),
#      VM_TEST_RUN (which tests, a -test.run pattern; default ^TestKernel:
#      all; packages without a top-level match are left out),
#      VM_TEST_COUNT (-test.count: reruns each selected test in one VM; the
#      summary then counts failures per test), VM_TEST_TIMEOUT (seconds per
#      test binary, default 900 x VM_TEST_COUNT: the root package's kernel tests take
#      5-10 minutes on a loaded 2-core host),
#      VM_TIMEOUT (seconds per kernel, boot included, default 2400: one binary hung to
#      its VM_TEST_TIMEOUT still leaves the others time to run and report), VM_* (see vm.sh)
# exit: 0 only if every kernel passed.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
read -r -a kernels <<<"${*:-${KERNELS:-6.1 7.3}}"
for k in "${kernels[@]}"; do suite_of "$k" >/dev/null; done
cd "$REPO"

# Test binaries go into the build dir inside the checkout: the guest reaches
# the checkout over 9p, but its /tmp is empty.
tests=$BUILD/tests
rm -rf "$tests"
mkdir -p "$tests"
manifest=$tests/manifest
: >"$manifest"
t0=$(now)
log "vmtest: building test binaries"
while read -r pkg dir; do
  rel=${dir#"$REPO"/}
  [ "$dir" = "$REPO" ] && rel=.
  bin=$tests/$(echo "${rel}" | tr / _ | sed 's/^\.$/root/').test
  go test -c -o "$bin" "$pkg"
  # Only packages that have kernel tests (of the selection) go into the VM;
  # a binary that cannot list its tests is an error, not a package without.
  list=$("$bin" -test.list "${VM_TEST_RUN:-^TestKernel}") || die "$bin -test.list failed"
  if grep -q '^TestKernel' <<<"$list"; then
    echo "$pkg $rel ${bin#"$REPO"/}" >>"$manifest"
  fi
done < <(go list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.ImportPath}} {{.Dir}}{{end}}' ./...)
log "vmtest: built in $(elapsed "$t0")s; packages with kernel tests:"
sed 's/^/  /' "$manifest" >&2
[ -s "$manifest" ] || die "no package has TestKernel* tests"

count=${VM_TEST_COUNT:-1}

# run_kernel K OUT runs the suite in a VM on kernel K, results under OUT.
run_kernel() {
  VM_OUT=$2 VM_TIMEOUT=${VM_TIMEOUT:-$((2400 * count))} "$REPO/integration/vm.sh" "$1" \
    "KTLS_TEST_MIB=${KTLS_TEST_MIB:-} KTLS_LOAD_TUNNELS=${KTLS_LOAD_TUNNELS:-} KTLS_LOAD_RELOADS=${KTLS_LOAD_RELOADS:-} KTLS_BINARY_DOWNLOAD_MIB=${KTLS_BINARY_DOWNLOAD_MIB:-} VM_TEST_RUN='${VM_TEST_RUN:-^TestKernel}' VM_TEST_COUNT=$count VM_TEST_TIMEOUT=${VM_TEST_TIMEOUT:-$((900 * count))} integration/guest-suite.sh ${manifest#"$REPO"/}"
}

# clock_jump TIMES prints "guest Cs, host Ws" and succeeds when the guest
# counted more than a minute beyond the host's wall time for the whole VM
# (vm.sh's times file: command=guest seconds, wall=host seconds).
clock_jump() {
  [ -f "$1" ] || return 1
  awk '{ for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] } }
    END { if (v["command"] != "" && v["wall"] != "" && v["command"] > v["wall"] + 60) {
      printf "guest %ss, host %ss\n", v["command"], v["wall"]; exit 0 } exit 1 }' "$1"
}

# failure_digest OUT prints, for each test binary's log under OUT, each
# failed test with the first lines it logged (cut to 300 characters) and,
# where the binary timed out, the first lines the last test to start
# logged and the tests that were running then (listed under "panic: test
# timed out"); at most 30 lines a log.
failure_digest() {
  local f
  for f in "$1"/*.test.log; do
    [ -f "$f" ] || continue
    awk -v b="$(basename "$f" .log)" '
      function say(s) { print b ": " substr(s, 1, 300) }
      /^=== (RUN|CONT)/ { n = 0; next }
      /^panic: test timed out/ { for (i = 0; i < n; i++) say("  " msg[i]); n = 0; say($0); running = 1; next }
      running && /^[ \t]*running tests:/ { next }
      running && /^[ \t]+Test/ { sub(/^[ \t]+/, ""); say("still running: " $0); next }
      running { running = 0 }
      /^[ \t]*--- FAIL/ { for (i = 0; i < n; i++) say("  " msg[i]); n = 0; sub(/^[ \t]+/, ""); say($0); next }
      /^[ \t]+[^ \t]+_test\.go:[0-9]+: / && n < 3 { m = $0; sub(/^[ \t]+/, "", m); msg[n++] = m }' "$f" | head -30
  done
}

summary=()
failed=0
for k in "${kernels[@]}"; do
  out=$BUILD/vm-$k
  rm -rf "$out" "$out.clock-jump"
  mkdir -p "$out"
  log "=== vmtest: kernel $k"
  rc=0
  run_kernel "$k" "$out" || rc=$?
  # Under TCG the guest's clock (clocksource=tsc, vm.sh) follows the host's
  # TSC, so the guest never sees more time pass than the host does, unless
  # the host's TSC itself jumped (a host VM paused and resumed): then every
  # timer in the guest fires at once and test binaries "time out" after a
  # few minutes of real time. Such a run proves nothing either way; it is
  # run once more, and the jump is logged.
  if [ $rc -ne 0 ] && jumped=$(clock_jump "$out/times"); then
    log "vmtest: kernel $k: the guest's clock jumped (${jumped}): running its suite once more"
    summary+=("kernel $k: first run void: the guest's clock jumped (${jumped})")
    mv "$out" "$out.clock-jump"
    mkdir -p "$out"
    rc=0
    run_kernel "$k" "$out" || rc=$?
  fi
  verdict=PASS
  [ $rc -eq 0 ] || verdict="FAIL (exit $rc)"
  # The kernel's own counters: a suite that never reached TLS_SW in the
  # kernel proves nothing, whatever the tests said.
  if [ -f "$out/tls_stat" ]; then
    tx=$(awk '$1 == "TlsTxSw" { print $2 }' "$out/tls_stat")
    rx=$(awk '$1 == "TlsRxSw" { print $2 }' "$out/tls_stat")
    if [ "${tx:-0}" -eq 0 ] || [ "${rx:-0}" -eq 0 ]; then
      verdict="FAIL (tls_stat: TlsTxSw=${tx:-absent} TlsRxSw=${rx:-absent}: the kernel TLS path never ran)"
    fi
  else
    tx=absent rx=absent
    [ "$verdict" = PASS ] && verdict="FAIL (no tls_stat from the guest)"
  fi
  [ "$verdict" = PASS ] || failed=1
  times=$(cat "$out/times" 2>/dev/null || echo "no timing: guest reported no result")
  summary+=("kernel $k: $verdict; $times; TlsTxSw=$tx TlsRxSw=$rx")
  if [ -s "$out/flake" ]; then
    while read -r line; do summary+=("  kernel $k $line"); done <"$out/flake"
  fi
  # What failed, repeated after the logs: a binary that timed out printed the
  # tests it was running above thousands of lines of goroutines, and whoever
  # reads only the end of the output must still see their names.
  if [ "$verdict" != PASS ]; then
    while read -r line; do summary+=("  kernel $k $line"); done < <(failure_digest "$out")
  fi
done
log "=== vmtest summary"
for s in "${summary[@]}"; do log "$s"; done
exit $failed

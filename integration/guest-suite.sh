#!/bin/sh
# Runs inside the VM (through vm.sh, in the chroot, working directory = the
# checkout): every kernel test binary listed in the manifest, each from its
# package directory as `go test` would, with KTLS_REQUIRE=1 so that a
# missing kernel feature fails instead of skipping.
#
# usage: guest-suite.sh MANIFEST   (lines: "<import path> <package dir> <test binary>")
# env: KTLS_TEST_MIB, KTLS_LOAD_TUNNELS, KTLS_LOAD_RELOADS, KTLS_BINARY_DOWNLOAD_MIB (passed on to the
#      tests), VM_TEST_RUN (-test.run pattern, default ^TestKernel),
#      VM_TEST_COUNT (-test.count, default 1; above 1 each binary's log ends
#      with a pass/fail count per test), VM_TEST_TIMEOUT (seconds per binary,
#      default 600), VM_OUT (results dir, set by vm.sh)
# Prints go-test-style closing lines ("ok  <pkg> <time>s" / "FAIL <pkg> ...")
# and exits non-zero if any binary failed, printed "--- FAIL" or "--- SKIP",
# or timed out. Copies /proc/net/tls_stat to $VM_OUT/tls_stat at the end.
set -u
manifest=${1:?usage: guest-suite.sh MANIFEST}
repo=$(pwd)
limit=${VM_TEST_TIMEOUT:-600}
run=${VM_TEST_RUN:-^TestKernel}
count=${VM_TEST_COUNT:-1}
export KTLS_REQUIRE=1
[ -n "${KTLS_TEST_MIB:-}" ] && export KTLS_TEST_MIB
[ -n "${KTLS_LOAD_TUNNELS:-}" ] && export KTLS_LOAD_TUNNELS
[ -n "${KTLS_LOAD_RELOADS:-}" ] && export KTLS_LOAD_RELOADS
[ -n "${KTLS_BINARY_DOWNLOAD_MIB:-}" ] && export KTLS_BINARY_DOWNLOAD_MIB
failed=0
uptime_s() { cut -d' ' -f1 /proc/uptime; }
echo "guest: kernel $(uname -r), KTLS_TEST_MIB=${KTLS_TEST_MIB:-default}," \
  "KTLS_LOAD_TUNNELS=${KTLS_LOAD_TUNNELS:-default} KTLS_LOAD_RELOADS=${KTLS_LOAD_RELOADS:-default}, tests $run"
while read -r pkg dir bin; do
  [ -n "$pkg" ] || continue
  log=$VM_OUT/$(basename "$bin").log
  t0=$(uptime_s)
  # -test.timeout panics with goroutine dumps before the outer timeout kills.
  (cd "$repo/$dir" && timeout -k 10 "$limit" "$repo/$bin" -test.run "$run" -test.count "$count" -test.v \
      -test.timeout "$((limit - 15))s" 2>&1; echo "exit $?" >"$log.rc") | tee "$log"
  rc=$(sed 's/^exit //' "$log.rc"); rm -f "$log.rc"
  secs=$(awk -v a="$t0" -v b="$(uptime_s)" 'BEGIN { printf "%.3f", b - a }')
  why=
  [ "$rc" -eq 0 ] || why="exit status $rc"
  [ "$rc" -eq 124 ] && why="timed out after ${limit}s"
  grep -q -- '--- FAIL' "$log" && why="${why:+$why, }--- FAIL"
  # A kernel test that skips inside the VM hides a broken kernel path.
  grep -q -- '--- SKIP' "$log" && why="${why:+$why, }--- SKIP in the VM"
  if [ "$count" -gt 1 ]; then
    # Top-level results only (subtests are indented): "flake: TestX 3/10 failed".
    sed -n 's/^--- \(PASS\|FAIL\): \([^ ]*\) .*/\1 \2/p' "$log" | sort -k2 | uniq -c |
      awk -v n="$count" -v b="$(basename "$bin")" '{ k[$3] = k[$3] " " $2 "=" $1; if ($2 == "FAIL") f[$3] = $1 }
        END { for (t in k) { all++; if (f[t]) { bad++; printf "flake: %s %d/%d failed (%s)\n", t, f[t], n, substr(k[t], 2) } }
              printf "flake: %s: %d tests x %d runs, %d failed at least once\n", b, all, n, bad }' |
      sort | tee -a "$VM_OUT/flake"
  fi
  if [ -z "$why" ]; then
    printf 'ok  \t%s\t%ss [vm kernel %s]\n' "$pkg" "$secs" "$(uname -r)"
  else
    printf 'FAIL\t%s\t%ss [vm kernel %s]: %s\n' "$pkg" "$secs" "$(uname -r)" "$why"
    failed=1
  fi
done <"$manifest"
echo "guest: /proc/net/tls_stat after the suite:"
cat /proc/net/tls_stat | tee "$VM_OUT/tls_stat"
exit $failed

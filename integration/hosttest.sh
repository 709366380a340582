#!/usr/bin/env bash
# Host tests: `go test -v ./...` with the given flags (make passes -race),
# output streamed and kept in the build dir, then a loud count of the kernel
# tests that skipped here because this host has no kTLS (they run in the VM).
#
# usage: hosttest.sh [go test flags...]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
cd "$REPO"
mkdir -p "$BUILD"
out=$BUILD/host-test.log
t0=$(now)
rc=0
go test -count=1 -v "$@" ./... 2>&1 | tee "$out" || rc=$?
secs=$(elapsed "$t0")
skipped=$(grep -cE -- '^ *--- SKIP: TestKernel' "$out" || true)
other=$(grep -E -- '^ *--- SKIP: ' "$out" | grep -vc -- '--- SKIP: TestKernel' || true)
echo
echo "=== host tests: go test $* ./... took ${secs}s, exit $rc"
[ "$skipped" -eq 0 ] || echo "!!! $skipped kernel tests SKIPPED on this host (no kTLS): they ran in the VM (make vmtest / make test)"
[ "$other" -eq 0 ] || echo "!!! $other other tests skipped: grep -- '--- SKIP' $out"
exit $rc

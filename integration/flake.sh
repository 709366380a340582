#!/usr/bin/env bash
# Reruns a selection of tests COUNT times in a row, to find a flaky one:
# in one VM on a kernel of the matrix (the TestKernel* tests matching RUN),
# or on this host (every package's tests matching RUN, with the go test
# flags given after HOG, -race from make). Prints, per test, how many of the
# COUNT runs failed, and exits non-zero if any did.
#
# usage: flake.sh KERNEL|host RUN COUNT HOG [go test flags...]
#   HOG=1 keeps every core of this machine busy meanwhile (busy loops at
#   nice 19), as a loaded CI box or a neighbour would.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
kernel=${1:?usage: flake.sh KERNEL|host RUN COUNT HOG [go test flags...]}
run=${2:?RUN: a -test.run pattern}
count=${3:?COUNT}
hog=${4:-0}
shift 4
cd "$REPO"
case "$count" in '' | *[!0-9]* | 0) die "COUNT=$count: want a positive integer" ;; esac

hogs=()
if [ "$hog" = 1 ]; then
  for _ in $(seq "$(nproc)"); do
    nice -n 19 sh -c 'while :; do :; done' &
    hogs+=($!)
  done
  trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
  log "flake: $(nproc) busy loops beside the tests"
fi

if [ "$kernel" != host ]; then
  VM_TEST_RUN=$run VM_TEST_COUNT=$count integration/vmtest.sh "$kernel"
  exit
fi

mkdir -p "$BUILD"
out=$BUILD/flake-host.log
t0=$(now)
rc=0
# go test's 10-minute default is per binary: COUNT runs of the root
# package under -race beside a busy machine need more.
go test -count="$count" -timeout "$((count * 20))m" -run "$run" -v "$@" ./... >"$out" 2>&1 || rc=$?
log "flake: host, go test -count=$count -run '$run' $* ./... took $(elapsed "$t0")s, exit $rc; log: $out"
# Top-level results only (subtests are indented).
sed -n 's/^--- \(PASS\|FAIL\): \([^ ]*\) .*/\1 \2/p' "$out" | sort -k2 | uniq -c |
  awk -v n="$count" '{ k[$3] = k[$3] " " $2 "=" $1; if ($2 == "FAIL") f[$3] = $1 }
    END { for (t in k) if (f[t]) printf "flake: %s %d/%d failed (%s)\n", t, f[t], n, substr(k[t], 2) }' | sort >&2
grep -E '^(FAIL|ok|panic:)' "$out" >&2 || true
exit $rc

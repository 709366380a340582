#!/usr/bin/env bash
# Host Go benchmarks with wall-clock meaning (issue 7, item 6): the splice
# relay against userspace io.CopyBuffer relays (splice/), the handshake with
# offload setup against a plain crypto/tls handshake (ktls/), and preamble
# verification against a bare Ed25519 verify (preamble/). This host has no
# kTLS, so nothing here touches kernel TLS; the kernel figures come from the
# VM harness (make bench).
#
# The contenders of each comparison run side by side in every round, and the
# rounds interleave the packages, so that load from other processes on a
# shared machine falls on all of them alike. Every benchmark runs a fixed
# iteration count (the same work in every round), and the relay and handshake
# benchmarks report process CPU time (getrusage), which moves far less with
# load than ns/op.
#
# usage: bench-host.sh            (writes docs/bench/host.md)
# env: BENCH_ROUNDS (rounds, default 15, at least 3; about 9 s each),
#      BENCH_HOST_OUT (the markdown file, default docs/bench/host.md)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
cd "$REPO"

rounds=${BENCH_ROUNDS:-15}
[ "$rounds" -ge 3 ] || die "BENCH_ROUNDS=$rounds: medians and spreads need at least 3 rounds"
md=${BENCH_HOST_OUT:-docs/bench/host.md}
work=$BUILD/bench-host
rm -rf "$work"
mkdir -p "$work" "$(dirname "$md")"

t0=$(now)
log "bench-host: building benchmark binaries"
for pkg in splice ktls preamble; do
  go test -c -o "$work/$pkg.test" "./$pkg"
done
go build -o "$work/benchreport" ./integration/benchreport

# bench PKG REGEXP BENCHTIME: one round of PKG's benchmarks, run from the
# package directory as `go test` would (preamble reads its testdata).
bench() {
  (cd "$1" && "$work/$1.test" -test.run '^$' -test.bench "$2" -test.benchtime "$3" \
    -test.benchmem -test.count 1)
}

raw=$work/raw.txt
{
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# host: $(uname -sr), $(nproc) CPUs ($(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo))"
  echo "# go: $(go version)"
  echo "# rounds: $rounds"
  echo "# loadavg-before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$raw"
for i in $(seq "$rounds"); do
  log "bench-host: round $i/$rounds"
  # 2 GiB per relay variant, 400 handshakes per arm, 20000 verifies:
  # one to two seconds each on the 2-core CI machine.
  bench splice '^BenchmarkRelay$' 2048x >>"$raw"
  bench ktls '^BenchmarkHandshake$' 400x >>"$raw"
  bench preamble '^Benchmark(Verify|Parse|Ed25519Verify)$' 20000x >>"$raw"
done
echo "# loadavg-after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$raw"

"$work/benchreport" host -in "$raw" -md "$md"
log "bench-host: wrote $md in $(elapsed "$t0")s (raw output: ${raw#"$REPO"/})"

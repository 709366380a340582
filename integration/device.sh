#!/usr/bin/env bash
# The native figures of issues 34 and 35 in one call of a lent machine with
# cores to spare (the session's `device` tool: one command of at most 600 s,
# no Go toolchain there, 64 MiB of tree and carried files, root).
#
# usage: integration/device.sh kit   here: build the kit (stripped,
#                                    xz-compressed binaries of this checkout)
#                                    into $BUILD/device-kit, some 21 MiB
#        integration/device.sh run   there: unpack the kit and measure,
#                                    writing $OUT/device.md and the logs
#
# The call, from the session (.dev/ and other untracked scratch must be
# ignored first, in .git/info/exclude, or the tree is over 64 MiB):
#   run(command="integration/device.sh run", carry=["integration/.build/device-kit"], timeout_s=600)
#
# What it measures, each step bounded so the whole fits in 540 s and a step
# that runs out still leaves its log:
#   1. kTLS: whether the kernel has it (/proc/net/tls_stat, after modprobe
#      tls). The one device kind seen so far (Linux 6.18.44 under
#      Firecracker, 2026-12-04) had none; then every contender runs
#      userspace TLS (the forwarder as ktls-off) and the figures are those
#      of the mechanisms around kTLS, not of kTLS.
#   2. The upgrade's move (issue 35): BenchmarkMoveIdleTunnels with 10,000
#      idle tunnels, window 8, three times, each followed by
#      BenchmarkKernelMoveIdleTunnels (kernel TLS tunnels; it skips on a
#      kernel without kTLS) (docs/bench/upgrade.md; this host's
#      descriptor limit stops at 4,700).
#   3. The open-loop load run (issue 34, docs/bench/overload.md): per-call
#      and reuse, the contender on CPUs 0-1 and the generator on the rest,
#      ktls (or ktls-off) against caddy-l4 (and reverse_proxy per call);
#      HAProxy and nginx too where the machine has them.
# env: DEVICE_SIZE=small (1,000 tunnels and short steps: the check of this
#      script on a 2-core host), DEVICE_BUDGET (seconds for the whole, 540)
set -uo pipefail
. "$(dirname "$0")/lib.sh"
cd "$REPO"
KIT=$BUILD/device-kit

case ${1:-} in
kit)
  set -e
  rm -rf "$KIT"
  mkdir -p "$KIT"
  # Stripped: the unstripped Caddy alone is over the 64 MiB a call carries.
  go build -ldflags='-s -w' -o "$KIT/caddy" ./cmd/caddy
  go build -ldflags='-s -w' -o "$KIT/bench" ./integration/bench
  go test -c -ldflags='-s -w' -o "$KIT/forward.test" ./forward
  commit=$(git rev-parse HEAD)
  [ -n "$(git status --porcelain --untracked-files=no)" ] && commit+=" with uncommitted changes"
  echo "$commit" >"$KIT/commit"
  for f in caddy bench forward.test; do xz -T0 -6 "$KIT/$f"; done
  log "device kit: $(du -sh "$KIT" | cut -f1) in $KIT ($(cat "$KIT/commit"))"
  exit 0 ;;
run) ;;
*) die "usage: $0 kit|run" ;;
esac

OUT=${OUT:?run writes its results under \$OUT}
[ -f "$KIT/commit" ] || die "no kit in $KIT: run '$0 kit' here and carry it"
commit=$(cat "$KIT/commit")
start=$(now)
budget=${DEVICE_BUDGET:-540}
left() { awk -v s="$start" -v b="$budget" -v n="$(now)" 'BEGIN { printf "%d", b - (n - s) }'; }
md=$OUT/device.md
say() { printf '%s\n' "$*" >>"$md"; log "$*"; }

# The machine has python3 but may lack xz.
bin=/tmp/device-kit
mkdir -p "$bin"
for f in caddy bench forward.test; do
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$KIT/$f.xz" "$bin/$f" || die "unpack $f"
  chmod +x "$bin/$f"
done

ncpu=$(nproc)
say "# Device run of $commit"
say ""
say "- $(uname -srm), $ncpu CPUs, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
modprobe tls 2>/dev/null
if [ -e /proc/net/tls_stat ]; then
  ktls=yes fwd=ktls
  say "- kTLS: yes (/proc/net/tls_stat)"
else
  ktls=no fwd=ktls-off
  say "- kTLS: **no** (no /proc/net/tls_stat after modprobe tls): the forwarder runs as ktls-off, userspace TLS"
fi
ulimit -n 1048576 2>/dev/null || ulimit -n "$(ulimit -Hn)"
say "- descriptors: $(ulimit -n)"

small=${DEVICE_SIZE:-}
if [ "$small" = small ]; then
  move_tunnels=1000 tunnels=500 step=1 search=1 per_call_max=200 reuse_max=400
else
  move_tunnels=10000 tunnels=4000 step=2 search=3 per_call_max=25600 reuse_max=51200
fi

# step NAME SECONDS CMD...: runs CMD with at most SECONDS (and never past
# the budget), its output in $OUT/NAME.log; says how it ended.
step() {
  local name=$1 secs=$2
  shift 2
  local l
  l=$(left)
  [ "$secs" -gt "$l" ] && secs=$l
  if [ "$secs" -lt 10 ]; then
    say "- $name: not run (budget spent)"
    return 1
  fi
  local t0 rc=0
  t0=$(now)
  timeout -k 5 "$secs" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    say "- $name: stopped at its ${secs} s (log: $name.log)"
  else
    say "- $name: exit $rc in $(elapsed "$t0") s (log: $name.log)"
  fi
  return $rc
}

say ""
say "## The upgrade's move (issue 35)"
say ""
step move 210 bash -c "cd forward && for i in 1 2 3; do '$bin/forward.test' -test.run '^\$' \
  -test.bench MoveIdleTunnels -test.benchtime 1x -move-tunnels $move_tunnels -move-window 8; done"
grep -hE '^Benchmark(Kernel)?MoveIdleTunnels' "$OUT/move.log" | sed 's/^/    /' >>"$md"

say ""
say "## Under load (issue 34)"
say ""
peers=l4-proxy
for p in haproxy nginx; do command -v "$p" >/dev/null && peers+=",$p"; done
# The contender on two CPUs, the generator on the rest (a 2-CPU check: one each).
if [ "$ncpu" -le 2 ]; then pin=0 gen=1; else pin=0,1 gen="2-$((ncpu - 1))"; fi
# Half of what is left each: per-call first (its shedding is the goal).
half=$(( $(left) / 2 ))
step load-percall "$half" taskset -c "$gen" "$bin/bench" load -mode native -pin-contender "$pin" \
  -caddy "$bin/caddy" -commit "$commit" -label device-percall \
  -contenders "$fwd,$peers,reverse-proxy" -shapes per-call -tunnels "$tunnels" -targets 1000 -bulk 4 \
  -step "$step" -unloaded-rate 100 -unloaded-step 4 -max-rate "$per_call_max" -search-steps "$search" \
  -out "$OUT/load-percall.json"
step load-reuse "$(left)" taskset -c "$gen" "$bin/bench" load -mode native -pin-contender "$pin" \
  -caddy "$bin/caddy" -commit "$commit" -label device-reuse \
  -contenders "$fwd,$peers" -shapes reuse -tunnels "$tunnels" -targets 1000 -bulk 4 \
  -step "$step" -unloaded-rate 200 -unloaded-step 4 -max-rate "$reuse_max" -search-steps "$search" \
  -out "$OUT/load-reuse.json"
say ""
say "Render here: go run ./integration/benchreport load -in load-percall.json -md load-percall.md (and reuse)."
say "Whole run: $(elapsed "$start") s, kTLS $ktls."

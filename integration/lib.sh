# shellcheck shell=bash
# Shared by the integration scripts: where things live and how kernel names
# map to Debian suites. Source it; it defines no side effects beyond variables.

# REPO is the checkout root; every script runs from anywhere.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# BUILD holds everything the harness generates (ignored by git): test
# binaries, per-kernel guest output, logs. It lives inside the checkout
# because the guest sees the checkout over 9p but gets an empty /tmp.
BUILD=${KTLS_BUILD_DIR:-$REPO/integration/.build}
# KERNEL_CACHE holds downloaded .debs and extracted kernels (k-<kver>/),
# shared by all checkouts of the project.
KERNEL_CACHE=${KTLS_KERNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/caddy-ktls/kernels}

# The kernel matrix: short name -> Debian suite that ships that series in its
# generic amd64 flavour (which has virtio-9p, unlike the cloud flavour).
suite_of() {
  case "$1" in
    6.1) echo bookworm ;;
    6.12) echo trixie ;;
    7.3) echo trixie-backports ;;
    *) echo "unknown kernel '$1': use one of 6.1 (bookworm), 6.12 (trixie), 7.3 (trixie-backports)" >&2; return 1 ;;
  esac
}

log() { printf '%s\n' "$*" >&2; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

# now prints a monotonic-enough wall clock in seconds with centiseconds.
now() { date +%s.%N; }
# elapsed START prints seconds since START with one decimal.
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# apt_lock_holder FILE prints the PID of a process that holds a lock on
# FILE (from /proc/locks: apt and dpkg lock with fcntl), "-1" for an open
# file description lock, nothing when none does.
apt_lock_holder() {
  local ino dev maj min
  [ -e "$1" ] || return 0
  read -r ino dev < <(stat -L -c '%i %d' "$1") || return 0
  maj=$(( (dev >> 8) & 0xfff )) min=$(( (dev & 0xff) | ((dev >> 12) & 0xfff00) ))
  awk -v id="$(printf '%02x:%02x:%s' "$maj" "$min" "$ino")" \
    '$2 != "->" && $6 == id { print $5; exit }' /proc/locks
}

# apt_wait_locks waits until no process holds apt's or dpkg's locks (on a
# fresh cloud VM unattended-upgrades holds them for minutes), at most
# APT_LOCK_WAIT seconds (default 600), saying on stderr which lock it waits
# for and who holds it; it fails when the time is up. APT_LOCK_ROOT
# prefixes the lock paths (the tests' own root).
apt_wait_locks() {
  # $SECONDS counts whole seconds from an arbitrary phase, so a bound of
  # N could expire after N-1 s; the microsecond clock keeps it exact.
  local root=${APT_LOCK_ROOT:-} bound=${APT_LOCK_WAIT:-600} said= held f pid
  local start=${EPOCHREALTIME//[!0-9]/} waited
  while :; do
    held=
    for f in "$root"/var/lib/dpkg/lock-frontend "$root"/var/lib/dpkg/lock \
      "$root"/var/lib/apt/lists/lock "$root"/var/cache/apt/archives/lock; do
      pid=$(apt_lock_holder "$f")
      [ -n "$pid" ] || continue
      if [ "$pid" = -1 ]; then
        held="$f (held through an open file description)"
      else
        held="$f (held by process $pid, $(cat "/proc/$pid/comm" 2>/dev/null || echo 'gone'))"
      fi
      break
    done
    waited=$(( (${EPOCHREALTIME//[!0-9]/} - start) / 1000000 ))
    if [ -z "$held" ]; then
      [ -z "$said" ] || log "apt: the lock is free after $waited s"
      return 0
    fi
    if (( ${EPOCHREALTIME//[!0-9]/} - start >= bound * 1000000 )); then
      log "ERROR: apt: $held is still locked after $bound s: another apt or dpkg is installing; let it finish (or raise APT_LOCK_WAIT=<seconds>) and run this again"
      return 1
    fi
    if [ "$held" != "$said" ]; then
      log "apt: waiting up to $bound s for $held: another apt or dpkg (unattended-upgrades on a fresh machine) is installing"
      said=$held
    fi
    sleep 1
  done
}

# apt_get runs apt-get once no other process holds apt's locks
# (apt_wait_locks); DPkg::Lock::Timeout covers a process that takes the
# dpkg lock in between.
apt_get() {
  apt_wait_locks && apt-get -o "DPkg::Lock::Timeout=${APT_LOCK_WAIT:-600}" "$@"
}

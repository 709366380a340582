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

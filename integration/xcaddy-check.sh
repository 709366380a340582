#!/usr/bin/env bash
# Proves that an xcaddy-built Caddy carries this project: its build info
# names the module, it registers the same caddy-ktls Caddy modules as the
# in-repo build (cmd/caddy, `make build`), and its `ktls probe` subcommand runs.
#
# usage: xcaddy-check.sh XCADDY_BINARY REFERENCE_BINARY
set -euo pipefail
XC=${1:?usage: xcaddy-check.sh XCADDY_BINARY REFERENCE_BINARY}
REF=${2:?usage: xcaddy-check.sh XCADDY_BINARY REFERENCE_BINARY}
MOD=github.com/ktlsingress/caddy-ktls
fail() { echo "xcaddy-check: FAIL: $*" >&2; exit 1; }

"$XC" build-info | grep -q "^dep[[:space:]]*$MOD[[:space:]]" || fail "$XC build-info does not list $MOD"
"$XC" build-info | grep -q "^dep[[:space:]]*github.com/mholt/caddy-l4[[:space:]]*v0.1.2" || fail "$XC build-info does not list caddy-l4 v0.1.2"

# IDs of the Caddy modules registered from this project's packages. In the
# in-repo build this project is the main module, which Caddy prints without a
# package (it only knows dependencies' paths); under xcaddy it is a dependency.
ours() { "$1" list-modules --packages --skip-standard | awk -v m="$MOD" 'NF == 1 || $2 == m || index($2, m "/") == 1 { print $1 }'; }
want=$(ours "$REF")
got=$(ours "$XC")
[ -n "$want" ] || fail "$REF registers no caddy-ktls modules"
[ "$got" = "$want" ] || fail "caddy-ktls modules differ from the in-repo build:
xcaddy:
$got
in-repo:
$want"
"$XC" list-modules | grep -q '^layer4$' || fail "$XC lacks the layer4 app"
out=$("$XC" ktls probe) || fail "$XC ktls probe exited non-zero"
case "$out" in
  "kernel TLS available"*|"kernel TLS unavailable"*) ;;
  *) fail "unexpected ktls probe output: $out" ;;
esac
n=$(printf '%s\n' "$want" | grep -c . || true)
echo "xcaddy-check: ok: $XC includes $MOD ($n Caddy modules from it, same as $REF), caddy-l4 v0.1.2, and \`caddy ktls probe\`"

#!/usr/bin/env bash
# End-to-end demo of the sandbox data path: build Caddy and a demo upstream,
# make a CA, a forwarder certificate, a gateway client certificate and a
# gateway signing key, start the forwarder (examples/forwarder.Caddyfile)
# and the upstream, then open a tunnel like an edge gateway with
# `caddy sandbox dial` and show the reply, the tunnel's activity and the
# metrics. On a kernel without kTLS the forwarder falls back to userspace
# TLS (the log and /metrics say so); everything else is the same.
#
# Usage: examples/demo.sh   (from anywhere; needs go, openssl, curl)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEMO_DIR=$(mktemp -d)
export DEMO_DIR DEMO_LISTEN=127.0.0.1:9443 DEMO_ADMIN=127.0.0.1:2999 DEMO_UPSTREAM_PORT=9000
export XDG_DATA_HOME=$DEMO_DIR/data XDG_CONFIG_HOME=$DEMO_DIR/config
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$DEMO_DIR"
}
trap cleanup EXIT

echo "== build"
(cd "$ROOT" && go build -o bin/caddy ./cmd/caddy && go build -o "$DEMO_DIR/demo-upstream" ./examples/demo-upstream)
CADDY=$ROOT/bin/caddy

echo "== PKI and gateway key in $DEMO_DIR"
cd "$DEMO_DIR"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=demo-ca \
	-keyout ca-key.pem -out ca.pem 2>/dev/null
issue() { # name, subject CN, extensions
	openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" -keyout "$1-key.pem" -out "$1.csr" 2>/dev/null
	openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 1 -out "$1.pem" -extfile <(printf '%s\n' "$3") 2>/dev/null
}
issue server localhost "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
issue gateway gateway-1 "extendedKeyUsage=clientAuth"
"$CADDY" sandbox keygen --key-out gateway-signing.pem --pub-out gateways.pem --key-id gw-1

echo "== start upstream and forwarder"
"$DEMO_DIR/demo-upstream" -listen 127.0.0.1:$DEMO_UPSTREAM_PORT 2>upstream.log &
pids+=($!)
"$CADDY" run --adapter caddyfile --config "$ROOT/examples/forwarder.Caddyfile" 2>caddy.log &
pids+=($!)
for _ in $(seq 100); do curl -fsS "http://$DEMO_ADMIN/config/" >/dev/null 2>&1 && break; sleep 0.1; done

echo "== gateway: open a tunnel to sandbox demo-1 -> 127.0.0.1:$DEMO_UPSTREAM_PORT"
reply=$(printf 'hello from the edge\n' | "$CADDY" sandbox dial --addr "$DEMO_LISTEN" --server-name localhost \
	--cert gateway.pem --key gateway-key.pem --ca ca.pem --signing-key gateway-signing.pem --key-id gw-1 \
	--sandbox demo-1 --target 127.0.0.1:$DEMO_UPSTREAM_PORT)
echo "reply: $reply"
[ "$reply" = "sandbox says: HELLO FROM THE EDGE" ] || { echo "unexpected reply"; cat caddy.log; exit 1; }

echo "== a tunnel to a refused target (cloud metadata) is closed without a word"
printf 'x' | "$CADDY" sandbox dial --addr "$DEMO_LISTEN" --server-name localhost \
	--cert gateway.pem --key gateway-key.pem --ca ca.pem --signing-key gateway-signing.pem --key-id gw-1 \
	--sandbox demo-1 --target 169.254.169.254:80 || true
grep -o '"msg":"sandbox tunnel rejected"[^}]*' caddy.log || true

echo "== GET /sandbox/activity"
curl -fsS "http://$DEMO_ADMIN/sandbox/activity"
echo "== metrics"
curl -fsS "http://$DEMO_ADMIN/metrics" | grep -E '^caddy_ktls_(sandbox_(tunnels|bytes)|handshakes_total\{reason="(none|no-kernel-support)"\}|relay_bytes)' || true
echo "== demo OK"

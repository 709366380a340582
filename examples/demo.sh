#!/usr/bin/env bash
# End-to-end demo of the sandbox data path. It makes a CA, a forwarder
# certificate, a gateway client certificate (`caddy sandbox certs`) and a
# gateway signing key (`caddy sandbox keygen`),
# starts the forwarder (examples/forwarder.Caddyfile) and the sandbox (an
# echo upstream and an HTTP app), then acts as the edge gateway with `caddy
# sandbox dial`: a greeting, then DEMO_MIB MiB of random bytes through the
# tunnel and back, checked with SHA-256. Then it starts the Caddy edge
# gateway (examples/gateway.Caddyfile) and goes user → gateway → forwarder
# → sandbox: curl over HTTP/1.1 and HTTP/2 (a greeting, an upload echoed
# back), and a raw TCP tunnel routed by server name with openssl s_client.
# It prints the kernel probe (`caddy ktls probe`), the bytes moved, whether
# the kernel path (kTLS, from /proc/net/tls_stat, and splice, from the
# metrics) or the userspace fallback carried them on each hop, a refused
# target, the activity endpoint and the metrics.
#
# Usage: examples/demo.sh   (needs openssl and curl; go unless DEMO_PREBUILT=1)
# env: DEMO_MIB (default 16), DEMO_PREBUILT=1 (use bin/caddy and
#      bin/demo-upstream as they are: `make demo` builds them on the host and
#      runs this script again inside a kTLS VM), DEMO_REQUIRE_KERNEL=1 (exit 1
#      when the fallback carried the tunnel: `make demo` sets it in the VM,
#      whose kernel has kTLS; a host without kTLS falls back legitimately)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MIB=${DEMO_MIB:-16}
DEMO_DIR=$(mktemp -d)
DEMO_LISTEN=127.0.0.1:9443 DEMO_ADMIN=127.0.0.1:2999 DEMO_UPSTREAM_PORT=9000 DEMO_APP_PORT=9001
DEMO_GATEWAY_ADMIN=127.0.0.1:2998 DEMO_GATEWAY_TCP=127.0.0.1:9445 DEMO_GATEWAY_HTTPS_PORT=8443
# The examples' environment (listed at the top of each): every sandbox on
# this host's loopback, which the forwarder refuses unless allowed by name.
export FWD_DIR=$DEMO_DIR FWD_LISTEN=$DEMO_LISTEN FWD_ADMIN=$DEMO_ADMIN FWD_ALLOW=127.0.0.1 FWD_ALLOW_PORTS=$DEMO_UPSTREAM_PORT-$DEMO_APP_PORT
export GW_DIR=$DEMO_DIR GW_FORWARDER=$DEMO_LISTEN GW_ADMIN=$DEMO_GATEWAY_ADMIN GW_TCP=$DEMO_GATEWAY_TCP GW_HTTPS_PORT=$DEMO_GATEWAY_HTTPS_PORT
export GW_APP_TARGET=127.0.0.1:$DEMO_APP_PORT GW_TCP_TARGET=127.0.0.1:$DEMO_UPSTREAM_PORT
export XDG_DATA_HOME=$DEMO_DIR/data XDG_CONFIG_HOME=$DEMO_DIR/config
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$DEMO_DIR"
}
trap cleanup EXIT

CADDY=$ROOT/bin/caddy UPSTREAM=$ROOT/bin/demo-upstream
if [ "${DEMO_PREBUILT:-}" != 1 ]; then
	echo "== build"
	(cd "$ROOT" && go build -o "$CADDY" ./cmd/caddy && go build -o "$UPSTREAM" ./examples/demo-upstream)
fi
echo "== kernel $(uname -r): caddy ktls probe"
"$CADDY" ktls probe

echo "== certificates (caddy sandbox certs) and gateway signing key in $DEMO_DIR"
cd "$DEMO_DIR"
# One CA for both sides; the forwarder's certificate for the name the
# gateway dials; the gateway's client certificate; the users' certificate
# for the gateway's sites.
"$CADDY" sandbox certs ca --dir . | grep '^wrote'
"$CADDY" sandbox certs forwarder --dir . --san forwarder.internal | grep '^wrote'
"$CADDY" sandbox certs gateway --dir . --cn gateway-1 | grep '^wrote'
"$CADDY" sandbox certs forwarder --dir . --name site --san '*.sandbox.test' | grep '^wrote'
"$CADDY" sandbox keygen --key-out gateway-signing.pem --pub-out gateways.pem --key-id gw-1

echo "== start the echo upstream and the forwarder"
"$UPSTREAM" -listen 127.0.0.1:$DEMO_UPSTREAM_PORT -http 127.0.0.1:$DEMO_APP_PORT 2>upstream.log &
pids+=($!)
"$CADDY" run --adapter caddyfile --config "$ROOT/examples/forwarder.Caddyfile" 2>caddy.log &
pids+=($!)
for _ in $(seq 300); do curl -fsS "http://$DEMO_ADMIN/config/" >/dev/null 2>&1 && break; sleep 0.1; done

# The gateway: mTLS to the forwarder, a preamble bound to that session and
# signed with the gateway key, then stdin/stdout through the tunnel.
dial() { # target
	"$CADDY" sandbox dial --addr "$DEMO_LISTEN" --server-name forwarder.internal \
		--cert gateway.pem --key gateway-key.pem --ca ca.pem --signing-key gateway-signing.pem --key-id gw-1 \
		--sandbox demo-1 --target "$1"
}
tls_stat() { # counter name: its value, 0 when the kernel has no kTLS
	awk -v k="$1" '$1 == k { v = $2 } END { print v + 0 }' /proc/net/tls_stat 2>/dev/null || echo 0
}
metric() { # metric line pattern: its value (sum), 0 when absent
	curl -fsS "http://$DEMO_ADMIN/metrics" | awk -v p="$1" 'index($0, p) == 1 { s += $NF } END { printf "%d", s }'
}
tx0=$(tls_stat TlsTxSw) rx0=$(tls_stat TlsRxSw)
spliced0=$(metric 'caddy_ktls_relay_bytes_total{path="splice"}') copied0=$(metric 'caddy_ktls_relay_bytes_total{path="copy"}')

echo "== gateway: greeting to sandbox demo-1 at 127.0.0.1:$DEMO_UPSTREAM_PORT"
reply=$(printf 'hello from the edge\n' | dial 127.0.0.1:$DEMO_UPSTREAM_PORT)
echo "echoed: $reply"
[ "$reply" = "hello from the edge" ] || { echo "FAIL: unexpected reply"; cat caddy.log; exit 1; }

echo "== gateway: $MIB MiB of random bytes through the tunnel and back"
head -c $((MIB << 20)) /dev/urandom >payload
start=$(date +%s.%N)
dial 127.0.0.1:$DEMO_UPSTREAM_PORT <payload >echoed
secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
sent=$(sha256sum <payload | cut -d' ' -f1) got=$(sha256sum <echoed | cut -d' ' -f1)
echo "sent     $(stat -c %s payload) bytes sha256 $sent"
echo "received $(stat -c %s echoed) bytes sha256 $got  ($secs s)"
[ "$sent" = "$got" ] || { echo "FAIL: SHA-256 mismatch"; tail -20 caddy.log; exit 1; }
echo "SHA-256 OK"

# Tunnel counters are folded into the metrics when a tunnel closes.
for _ in $(seq 50); do
	[ "$(metric caddy_ktls_sandbox_tunnels_active)" = 0 ] && break
	sleep 0.1
done
tx=$(( $(tls_stat TlsTxSw) - tx0 )) rx=$(( $(tls_stat TlsRxSw) - rx0 ))
spliced=$(( $(metric 'caddy_ktls_relay_bytes_total{path="splice"}') - spliced0 ))
copied=$(( $(metric 'caddy_ktls_relay_bytes_total{path="copy"}') - copied0 ))
echo "== data path: tls_stat TlsTxSw +$tx TlsRxSw +$rx; relay bytes: $spliced spliced, $copied copied in userspace"
if [ "$tx" -gt 0 ] && [ "$rx" -gt 0 ] && [ "$spliced" -gt 0 ] && [ "$copied" = 0 ]; then
	echo "KERNEL PATH: kTLS (TLS_TX + TLS_RX in the kernel) and splice(2); no tenant byte entered userspace"
else
	echo "FALLBACK: userspace TLS and copy (kernel probe: $("$CADDY" ktls probe | head -1))"
	if [ "${DEMO_REQUIRE_KERNEL:-}" = 1 ]; then
		echo "FAIL: DEMO_REQUIRE_KERNEL=1 but the kernel path did not carry the tunnel"
		tail -20 caddy.log
		exit 1
	fi
fi

echo "== a tunnel to a refused target (cloud metadata) is refused without a byte"
if refusal=$(printf 'x' | dial 169.254.169.254:80 2>&1 >/dev/null); then
	echo "FAIL: the tunnel to the refused target ended as if it had run"
	exit 1
fi
echo "gateway: $refusal"
if [ "${DEMO_REQUIRE_KERNEL:-}" = 1 ] && [[ $refusal != *"tls: access denied"* ]]; then
	echo "FAIL: DEMO_REQUIRE_KERNEL=1 but the gateway did not read the access_denied refusal"
	exit 1
fi
for _ in $(seq 20); do grep -q 'sandbox tunnel rejected' caddy.log && break; sleep 0.1; done
grep -o '"msg":"sandbox tunnel rejected"[^}]*' caddy.log || { echo "FAIL: no rejection logged"; exit 1; }

echo "== the edge gateway (examples/gateway.Caddyfile): user -> gateway -> forwarder -> sandbox"
"$CADDY" run --adapter caddyfile --config "$ROOT/examples/gateway.Caddyfile" 2>gateway.log &
pids+=($!)
for _ in $(seq 300); do curl -fsS "http://$DEMO_GATEWAY_ADMIN/config/" >/dev/null 2>&1 && break; sleep 0.1; done
gmetric() { # metric line pattern at the gateway: its value (sum), 0 when absent
	curl -fsS "http://$DEMO_GATEWAY_ADMIN/metrics" | awk -v p="$1" 'index($0, p) == 1 { s += $NF } END { printf "%d", s }'
}
user_curl() { # curl as a user of sandbox demo-1 through the gateway
	curl -fsS --cacert ca.pem --resolve "demo-1.sandbox.test:$DEMO_GATEWAY_HTTPS_PORT:127.0.0.1" "$@"
}
tx0=$(tls_stat TlsTxSw) rx0=$(tls_stat TlsRxSw)
for v in --http1.1 --http2; do
	out=$(user_curl "$v" "https://demo-1.sandbox.test:$DEMO_GATEWAY_HTTPS_PORT/hello")
	echo "curl $v: $out"
	[[ $out == "hello from the sandbox app: demo-1.sandbox.test:$DEMO_GATEWAY_HTTPS_PORT over HTTP/1.1" ]] ||
		{ echo "FAIL: unexpected answer through the gateway"; tail -20 gateway.log; exit 1; }
done
user_curl --http2 -X POST --data-binary @payload -o http-echoed "https://demo-1.sandbox.test:$DEMO_GATEWAY_HTTPS_PORT/echo"
got=$(sha256sum <http-echoed | cut -d' ' -f1)
echo "curl --http2 upload of $(stat -c %s payload) bytes, echoed back: sha256 $got"
[ "$sent" = "$got" ] || { echo "FAIL: SHA-256 mismatch through the HTTP gateway"; tail -20 gateway.log; exit 1; }
spliced0=$(gmetric 'caddy_ktls_gateway_relay_bytes_total{path="splice"}') copied0=$(gmetric 'caddy_ktls_gateway_relay_bytes_total{path="copy"}')
# -no_ign_eof: end the session (close_notify) once stdin ends, after the echo.
reply=$( (printf 'hello over raw TCP\n'; sleep 2) | timeout 20 openssl s_client -quiet -no_ign_eof -connect "$DEMO_GATEWAY_TCP" \
	-servername demo-1.sandbox.test -CAfile ca.pem 2>/dev/null || true)
echo "openssl s_client -servername demo-1.sandbox.test: $reply"
[ "$reply" = "hello over raw TCP" ] || { echo "FAIL: unexpected raw TCP echo"; tail -20 gateway.log; exit 1; }
for _ in $(seq 50); do
	[ "$(gmetric 'caddy_ktls_gateway_tunnel_ends_total{end="closed",module="layer4.handlers.sandbox_proxy"}')" -gt 0 ] && break
	sleep 0.1
done
tx=$(( $(tls_stat TlsTxSw) - tx0 )) rx=$(( $(tls_stat TlsRxSw) - rx0 ))
spliced=$(( $(gmetric 'caddy_ktls_gateway_relay_bytes_total{path="splice"}') - spliced0 ))
copied=$(( $(gmetric 'caddy_ktls_gateway_relay_bytes_total{path="copy"}') - copied0 ))
echo "== gateway data path: tls_stat TlsTxSw +$tx TlsRxSw +$rx (both hops); raw TCP relay at the gateway: $spliced spliced, $copied copied"
# The HTTP tunnel: gateway client + forwarder server; the raw TCP one: the
# user-facing session, the gateway client, the forwarder server.
if [ "$tx" -ge 5 ] && [ "$rx" -ge 5 ] && [ "$spliced" -gt 0 ] && [ "$copied" = 0 ]; then
	echo "KERNEL PATH ON BOTH HOPS: kTLS at the gateway and the forwarder; the raw TCP tunnel went kernel to kernel at the gateway too"
else
	echo "FALLBACK at the gateway: userspace TLS or copy"
	if [ "${DEMO_REQUIRE_KERNEL:-}" = 1 ]; then
		echo "FAIL: DEMO_REQUIRE_KERNEL=1 but the gateway hop did not run on the kernel path"
		tail -20 gateway.log
		exit 1
	fi
fi

echo "== GET /sandbox/activity"
curl -fsS "http://$DEMO_ADMIN/sandbox/activity"
echo
echo "== metrics"
curl -fsS "http://$DEMO_ADMIN/metrics" | grep -E '^caddy_ktls_(sandbox_(tunnels|bytes|rejects_total\{reason="target-denied"\})|handshakes_total\{module="layer4\.handlers\.ktls",reason="(none|no-kernel-support)"\}|relay_bytes)'
curl -fsS "http://$DEMO_GATEWAY_ADMIN/metrics" | grep -E '^caddy_ktls_gateway_(dials_total\{[^}]*result="ok"|tunnel_ends_total|relay_bytes_total)' | grep -v ' 0$'
echo "== demo OK"

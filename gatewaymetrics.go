package caddyktls

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// The gateway modules' counters, process-level like the other metrics.
var (
	gatewayDials = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_dials_total",
		Help: "Tunnels the gateway modules tried to open, by module and result: ok, no-route (the placeholders gave no valid forwarder, sandbox or target), or the step that failed (connect, handshake, preamble). Nothing reached a sandbox unless ok.",
	}, []string{"module", "result"})
	gatewayResumed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_dials_resumed_total",
		Help: "Of the gateway modules' ok dials, those whose TLS session with the forwarder resumed an earlier one (resumption on): no certificate verified, nothing signed in the handshake.",
	}, []string{"module"})
	gatewayEnds = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_tunnel_ends_total",
		Help: "Opened gateway tunnels by module and how they ended: closed (in order), refused (the forwarder's access_denied: nothing reached the sandbox), failed (internal_error, a reset, a timeout).",
	}, []string{"module", "end"})
	gatewayRelayBytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_relay_bytes_total",
		Help: "Bytes the layer4 sandbox_proxy relayed, both directions, by data path: splice (never in userspace) or copy.",
	}, []string{"path"})
)

// The caddy_ktls_gateway_dials_total results besides the failed steps.
const (
	gatewayDialOK      = "ok"
	gatewayDialNoRoute = "no-route"
)

// The relay byte paths.
const (
	relayPathSplice = "splice"
	relayPathCopy   = "copy"
)

func init() {
	metrics.histograms = append(metrics.histograms, gatewayDials, gatewayResumed, gatewayEnds, gatewayRelayBytes)
	// Every series exists from the start, as the forwarder's do.
	for _, m := range []string{moduleSandboxProxy, moduleSandboxTransport} {
		for _, r := range []string{gatewayDialOK, gatewayDialNoRoute, gateway.StepConnect, gateway.StepHandshake, gateway.StepPreamble} {
			gatewayDials.WithLabelValues(m, r)
		}
		gatewayResumed.WithLabelValues(m)
		for _, e := range []gateway.End{gateway.EndClosed, gateway.EndRefused, gateway.EndFailed} {
			gatewayEnds.WithLabelValues(m, string(e))
		}
	}
	gatewayRelayBytes.WithLabelValues(relayPathSplice)
	gatewayRelayBytes.WithLabelValues(relayPathCopy)
}

// countDialOK counts module's opened tunnel, and whether its session
// resumed.
func countDialOK(module string, tunnel *ktls.Conn) {
	gatewayDials.WithLabelValues(module, gatewayDialOK).Inc()
	if tunnel.ConnectionState().DidResume {
		gatewayResumed.WithLabelValues(module).Inc()
	}
}

package caddyktls

import (
	"io"
	"net"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/modules/edgegateway"
)

// A tunnel's end counts once, when it is closed and no request on it is
// in flight, and what a request saw wins over the tunnel's read error in
// either order: net/http closes a tunnel as soon as a body read fails,
// before the failure reaches the body's reader.
func TestSandboxTransportTunnelEndOrder(t *testing.T) {
	for _, tc := range []struct {
		name string
		// steps on one tunnel whose peer closed (its read error is io.EOF):
		// 'b' a request begins, 'c' the transport closes the tunnel,
		// 'f' a request is done having seen the tunnel fail, 'r' refused,
		// 'o' done with nothing to say.
		steps string
		want  gateway.End
	}{
		{"closed while the failed body is still being read", "bcf", gateway.EndFailed},
		{"failure seen before the close", "bfc", gateway.EndFailed},
		{"refused before the response", "bcr", gateway.EndRefused},
		{"idle tunnel whose peer closed", "c", gateway.EndClosed},
		{"a response read to its end", "boc", gateway.EndClosed},
		{"two streams, the second fails after the close", "bbcof", gateway.EndFailed},
		{"the first failure is the tunnel's", "bbcrf", gateway.EndRefused},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := net.Pipe()
			b.Close()
			c := &edgegateway.TunnelConn{Conn: a}
			if _, err := c.Read(make([]byte, 1)); err != io.EOF {
				t.Fatalf("read from a closed pipe: %v", err)
			}
			before := map[gateway.End]float64{}
			ends := []gateway.End{gateway.EndClosed, gateway.EndRefused, gateway.EndFailed}
			for _, e := range ends {
				before[e] = transportEnds(t, e)
			}
			for i, s := range tc.steps {
				switch s {
				case 'b':
					c.Begin()
				case 'c':
					c.Close()
				case 'f':
					c.Done(gateway.EndFailed)
				case 'r':
					c.Done(gateway.EndRefused)
				case 'o':
					c.Done(gateway.EndClosed)
				}
				counted := false
				for _, e := range ends {
					counted = counted || transportEnds(t, e) != before[e]
				}
				if last := i == len(tc.steps)-1; counted != last {
					t.Fatalf("after %q: counted %v, want %v", tc.steps[:i+1], counted, last)
				}
			}
			for _, e := range ends {
				want := 0.0
				if e == tc.want {
					want = 1
				}
				if got := transportEnds(t, e) - before[e]; got != want {
					t.Errorf("%s ends moved by %v, want %v", e, got, want)
				}
			}
		})
	}
}

// transportEnds reads caddy_ktls_gateway_tunnel_ends_total of the sandbox
// transport for end, from the exposition Prometheus scrapes.
func transportEnds(t *testing.T, end gateway.End) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(edgegateway.GatewayEnds)
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	return parseMetrics(t, rec.Body.Bytes())[`caddy_ktls_gateway_tunnel_ends_total{end="`+string(end)+`",module="`+moduleid.SandboxTransport+`"}`]
}
